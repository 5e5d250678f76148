//! AMP frames, JSON Schema validation and error codes.
