"""Reading snapshots back: which snapshots a resume may use (policy, records), finding and reading a
snapshot with every chunk verified (loader), reading shared bytes once per job (read_once), the reads of a fit's
restore (reads), what they are read into (targets), the Restorer that runs them, and the later phases of a resume
(later_phases). Loading never unpickles.

May import: config, persist, state, backends, staging, format, plan, dist, errors.
"""
