"""Training: the Lightning task (:mod:`.task`), a run end to end (:mod:`.run`), the run folder it
writes and may replace (:mod:`.run_folder`), its logs (:mod:`.run_logging`, :mod:`.quiet`)."""
