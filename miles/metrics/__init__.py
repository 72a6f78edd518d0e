"""Training metrics: capture in the training process, the history store, and the gate."""
