"""The one reader of compiled programs (`compiled.as_text()`): parse once, query the records.

`parse(text)` cuts a module into its computations and each instruction into a record
(name, opcode, result arrays, operands, called computations, attributes as written, with
metadata, frontend attributes and backend_config read on demand). Queries over the records:
`groups` replica groups in every form the compilers print; `loops` each `while` and its
trip count; `matmuls` each dot and convolution with its FLOPs (one rule); `megascale` the
cross-slice host transfers of multi-slice TPU programs; `sources` an instruction's op_name
and source line; `dtypes` is the one table of element sizes. Collectives, costs, MXU fill,
buffers and the sharding report are built on these. A leaf: it imports nothing else of
shardax, so `sharding/` may import it.
"""

from shardax.perf.hlo.dtypes import BYTES, nbytes
from shardax.perf.hlo.module import (Array, arrays, Computation, Instruction, logical_layouts, memory_spaces,
                                     Module, parse)
from shardax.perf.hlo.loops import trip_counts, While, whiles

__all__ = ["Array", "arrays", "BYTES", "Computation", "Instruction", "logical_layouts", "memory_spaces", "Module", "nbytes",
           "parse", "trip_counts", "While", "whiles"]
