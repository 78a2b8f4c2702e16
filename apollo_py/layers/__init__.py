"""Fusion layers: layer1 (polyhedral fusion + tiling), layer2 (memory stitching), layer3
(parallel stitching + cost model).  Import the submodules directly, e.g.
``from apollo_py.layers.layer1 import fuse_micro_graph``."""
