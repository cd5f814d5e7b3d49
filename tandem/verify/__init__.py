"""Models of tandem's protocols, explored exhaustively for small sizes (torch-free). `pause_model`: pause, load
weights, continue, across the trainer, engine rank 0, its tensor-parallel followers and the requests."""
