"""Writing snapshots, off the training thread: the persist threads (threads), the data objects and
retention (writer), and THE commit rule, written once with its two transports (commit).

May import: backends, staging, format, plan, dist, errors.
"""
