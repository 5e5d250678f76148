//! HTTP/1.1 endpoints and WebSocket sessions over non-blocking sockets.
