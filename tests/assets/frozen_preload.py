"""Imported last by the fork server of the gloo ranks (tests/dist_utils.py's PRELOAD): the objects of the modules it
preloaded (torch, the project: some 300k) move to the collector's permanent generation, so that in every rank forked
from it a full collection (dist_utils' gc.collect() at the end of each run, the collector's own) scans what the
rank made, not the whole preloaded heap again (about 0.2 s a collection).

gc.freeze() is meant for this: a fork-based server freezing what it loaded before it forks its workers."""

import gc

gc.freeze()
