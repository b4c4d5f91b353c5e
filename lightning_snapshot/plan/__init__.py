"""Pure resharding geometry: the box a rank holds of a global tensor (boxes) and which bytes each rank
writes and reads (planner). No I/O, no process group.

May import: nothing of the package.
"""
