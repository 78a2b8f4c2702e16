"""isl helpers for layer 1 (DESIGN §5).

* :mod:`.statements` — statements with symbolic-size domains, accesses, dependences;
* :mod:`.schedule`   — one-group fused schedules under an operations budget, tiling;
* :mod:`.storage`    — intermediates as scalars or small tiles, never full tensors;
* :mod:`.reduce_forms` — canonical all / x / y reduce forms;
* :mod:`.ast_to_loopir` — isl AST -> loop IR, lane-accumulator reductions.

Every isl object of one compile job lives in that job's own ``isl.Context``.
"""
