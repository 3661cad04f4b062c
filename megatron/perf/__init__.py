"""Measuring training iterations: the benchmark's rows and their launch, and the lower bound of an iteration on this
device beside the measured one (docs/benchmarks.md, "Lower bound"). Top of the package order: it reads the
configuration and nothing imports it but scripts and tests.

rows.py names the benchmark's presets, configs and layouts by their axes and gives their flags, launch.py runs them
in fresh processes, steps.py builds a row's training step in this process and step_profile.py reports where its time
goes. For the bound, work.py counts the GEMMs and attentions of an iteration, traffic.py the bytes of its memory-bound
kernels and un-overlapped collectives (fsdp.py those FSDP adds), probes.py measures this device's rates (cached per
shape), bound.py combines them and report.py prints bound against measurement.
"""

from .bound import CATEGORIES, Bound, Term, lower_bound, padded_vocab
from .probes import ProbeError, Probes, cuda_measure, device_name, one_line
from .report import IDLE, Row, bound_table, category_table, kernel_category, terms_table
from .work import NotModelled

__all__ = [
    "CATEGORIES",
    "IDLE",
    "Bound",
    "NotModelled",
    "ProbeError",
    "Probes",
    "Row",
    "Term",
    "bound_table",
    "category_table",
    "cuda_measure",
    "device_name",
    "kernel_category",
    "lower_bound",
    "one_line",
    "padded_vocab",
    "terms_table",
]
