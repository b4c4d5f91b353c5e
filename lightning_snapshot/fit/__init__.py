"""One fit's wiring, on the training thread: the session (the fit's process groups, this rank's place, the tiers'
checks, the node agent, the arena and the persist threads), the snapshot pipeline (due, stage, finish, hand over),
the weights' stager, the replica check, the reporting of results and metrics, and the train loaders followed.

May import: config, persist, state, data, backends, staging, format, schedule, dist, errors (never the callback,
the restore or the CLI).
"""
