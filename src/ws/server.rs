pub struct WsServer;
pub struct SessionId;
pub enum SessionEvent {}
