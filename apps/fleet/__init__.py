"""Fleet operations: the model catalogue and the control client workers answer."""
