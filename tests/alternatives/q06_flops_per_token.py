def flops_per_token(cfg):
    """Training FLOPs per token, counted layer by layer (forward 2 per multiply-add, backward twice that)."""
    C, T = cfg.n_embd, cfg.block_size
    per_layer = 0
    for rows, cols in ((C, 3 * C), (C, C), (C, 4 * C), (4 * C, C)):   # qkv, attention out, MLP up, MLP down
        per_layer += rows * cols
    per_layer_attention = 2 * T * C                                      # q.k over T keys, then scores.v
    forward = 2 * (cfg.n_layer * (per_layer + per_layer_attention) + C * cfg.vocab_size)
    return 3 * forward
