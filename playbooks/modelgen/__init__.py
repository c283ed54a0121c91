"""Generated models: tiny real-format models with random weights, made on the controller for the
built-in CPU recipe and the tests (the operations on a host's model files are steps/weights/)."""
