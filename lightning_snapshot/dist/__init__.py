"""Collectives and agreements: the Comm protocols and their implementations (comm), the one way ranks agree
on an outcome, with the named forms broadcast and all_gather (agree), the library's own gloo groups (groups),
preemption (preempt) and fork safety of the library's threads (forksafe, forkprep).

May import: errors.
"""
