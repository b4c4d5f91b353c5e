"""When each tier snapshots: the tiers' schedules (schedules), the interval from the measured cost and
the failure rate (interval), and the goodput simulation behind ``lightning-snapshot plan`` (simulate). Pure: no
I/O, no process group.

May import: errors.
"""
