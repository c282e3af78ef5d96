"""Engine connectors: kvfsm rooms driven by an inference engine's own connector API."""
