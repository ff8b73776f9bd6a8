"""``moetrace placement``: the command (:mod:`.command`), its input (:mod:`.loads`), its plan (:mod:`.outcome`),
what it prints (:mod:`.text`, :mod:`.explain`, :mod:`.replan`) and the plan files it writes (:mod:`.format`)."""
