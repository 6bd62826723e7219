"""The keeping mechanism of each Keras backend."""
