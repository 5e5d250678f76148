//! Sans-IO NATS client connection and the thin mio shell that drives it.
