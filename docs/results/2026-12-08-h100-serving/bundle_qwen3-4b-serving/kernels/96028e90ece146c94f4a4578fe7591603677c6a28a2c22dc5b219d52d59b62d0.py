"""Candidate from template decoder_layer.decode_static for a decoder_layer/decode task (bfloat16)."""
from kernels_runtime.hosts.decode_layer import decode_static_layer

CONFIG = {'attn_BLOCK_N': 32, 'attn_num_splits': None, 'attn_num_stages': 2, 'attn_num_warps': 4, 'dn_BLOCK_K': 1024, 'dn_BLOCK_N': 4, 'dn_DOT': False, 'dn_DOT_BLOCK_K': 256, 'dn_DOT_BLOCK_N': 64, 'dn_DOT_SPLIT_K': 2, 'dn_PREFETCH': False, 'dn_SPLIT_K': 1, 'dn_TMA': 0, 'dn_TMA_LATE': False, 'dn_TMA_PRE': False, 'dn_num_warps': 4, 'dot_stages': 3, 'fma_max_m': 1, 'gu_BLOCK_K': 1024, 'gu_BLOCK_N': 4, 'gu_DOT': False, 'gu_DOT_BLOCK_K': 128, 'gu_DOT_BLOCK_N': 128, 'gu_DOT_SPLIT_K': 1, 'gu_PREFETCH': False, 'gu_SPLIT_K': 1, 'gu_TMA': 0, 'gu_TMA_LATE': False, 'gu_TMA_PRE': False, 'gu_num_warps': 4, 'l2pf_mlp_mb': 0, 'l2pf_o': False, 'norm_pass': True, 'num_stages': 1, 'o_BLOCK_K': 1024, 'o_BLOCK_N': 4, 'o_DOT': False, 'o_DOT_BLOCK_K': 256, 'o_DOT_BLOCK_N': 64, 'o_DOT_SPLIT_K': 2, 'o_PREFETCH': False, 'o_SPLIT_K': 1, 'o_num_warps': 4, 'pdl': True, 'pdl_max_m': 1, 'post_norm': 'gate_up_prologue', 'post_norm_batch': 'o_reduce', 'qkv_BLOCK_K': 1024, 'qkv_BLOCK_N': 4, 'qkv_DOT': False, 'qkv_DOT_BLOCK_K': 128, 'qkv_DOT_BLOCK_N': 64, 'qkv_DOT_SPLIT_K': 1, 'qkv_PREFETCH': False, 'qkv_SPLIT_K': 1, 'qkv_num_warps': 4}
_entry = decode_static_layer(CONFIG)


def entry(inputs, weights, state, static):
    return _entry(inputs, weights, state, static)
