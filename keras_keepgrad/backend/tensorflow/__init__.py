"""The keeping mechanism on TensorFlow."""
