//! A borrowed view of an inbound message, so the JetStream parsers work on whatever
//! holds the bytes (the client's `Message`, the broker's read buffer).

use crate::proto::headers::HeaderMap;

#[derive(Debug, Clone, Copy)]
pub struct Delivery<'a> {
    pub subject: &'a str,
    pub reply: Option<&'a str>,
    pub headers: Option<&'a HeaderMap>,
    pub payload: &'a [u8],
}

impl<'a> Delivery<'a> {
    pub fn status(&self) -> Option<u16> {
        self.headers.and_then(|h| h.status())
    }

    pub fn description(&self) -> Option<&'a str> {
        self.headers.and_then(|h| h.description())
    }

    pub fn header(&self, name: &str) -> Option<&'a str> {
        self.headers.and_then(|h| h.get(name))
    }
}
