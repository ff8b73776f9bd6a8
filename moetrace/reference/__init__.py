"""Reference MoE runtime."""
