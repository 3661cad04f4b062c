"""The lower bound of a training iteration on this device, beside the measured one (docs/benchmarks.md,
"Lower bound"). Top of the package order: it reads the configuration and nothing imports it but scripts and tests.

work.py counts the GEMMs and attentions of an iteration, traffic.py the bytes of its memory-bound kernels and
un-overlapped collectives (fsdp.py those FSDP adds), probes.py measures this device's rates (cached per shape),
bound.py combines them and report.py prints bound against measurement.
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
