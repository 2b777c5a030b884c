"""Test and benchmark harnesses that ship with the package (not imported by ``import hicache``).

* ``netns``: hosts with their own addresses on one machine (network namespaces on a private bridge).
* ``rehearsal``: a Ray cluster over those hosts (head, TPU-host stand-ins, a GCS emulator host, a client).
"""
