"""On-device sparse index (PIT micro-tile index, sequence-length rows, MoE expert lists)."""
from .tiles import (  # noqa: F401
    GROUPS,
    SUPPORTED_DTYPES,
    IndexBuilder,
    build_tile_index,
    expert_index_func,
    index_state,
    reference_expert_index,
    reference_seqlen_row_index,
    reference_tile_index,
    seqlen_row_index_func,
    tile_grid,
    tile_index_func,
    tiles_from_index,
)
from .tiles import __all__  # noqa: F401
from .attention import attention_block_index_func, reference_attention_block_index  # noqa: F401,E402
