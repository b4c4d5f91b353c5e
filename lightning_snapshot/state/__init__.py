"""Training state as registered parts: the Part interface and registry (parts), the built-in parts (builtin),
capture and restore of the trainer's state (capture), what Lightning's checkpoints leave out (fit_state,
fit_checkpoints, fit_metrics), Lightning's WeightAveraging as a tensor part (averaging), whether a snapshot's
optimizer and scheduler state fits the live trainer (compat), DDP's bucket layout (ddp_layout) and every write into
Lightning's private state (patches).

May import: data, staging, format, dist, errors (never a tier, the fit's wiring, the persist threads or the
restore).
"""
