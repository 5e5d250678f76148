//! Pull consumers (ADR-13): `CONSUMER.MSG.NEXT` requests and the classification of what
//! arrives on a pull's inbox — messages, and the 404/408/409/100 statuses.

use std::time::Duration;

use serde::Serialize;

use super::api::{ApiPrefix, Request, validate_name};
use super::error::JsError;
use super::message::Delivery;
use super::wire::opt_nanos;

/// The body of a `CONSUMER.MSG.NEXT` request.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct PullRequest {
    /// How many messages at most.
    pub batch: u64,
    /// The server ends the request after this long (with a 408).
    #[serde(with = "opt_nanos", skip_serializing_if = "Option::is_none")]
    pub expires: Option<Duration>,
    /// Answer at once: what is there, or a 404.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub no_wait: bool,
    /// How many bytes at most (a message over the limit ends the request with a 409).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_bytes: Option<u64>,
    /// Heartbeats (status 100) while the request waits; must be below `expires`.
    #[serde(with = "opt_nanos", skip_serializing_if = "Option::is_none")]
    pub idle_heartbeat: Option<Duration>,
}

impl PullRequest {
    pub fn batch(batch: u64) -> PullRequest {
        PullRequest {
            batch,
            ..PullRequest::default()
        }
    }
}

impl ApiPrefix {
    /// `CONSUMER.MSG.NEXT.<stream>.<consumer>`, to be published with the inbox the
    /// deliveries should go to as its reply subject (not a request/reply: many replies).
    pub fn pull_next(
        &self,
        stream: &str,
        consumer: &str,
        pull: &PullRequest,
    ) -> Result<Request, JsError> {
        validate_name("stream", stream)?;
        validate_name("consumer", consumer)?;
        if pull.batch == 0 {
            return Err(JsError::Invalid("pull batch must be at least 1".into()));
        }
        if let (Some(hb), Some(exp)) = (pull.idle_heartbeat, pull.expires)
            && hb >= exp
        {
            return Err(JsError::Invalid(
                "pull idle heartbeat must be shorter than expires".into(),
            ));
        }
        Ok(Request::json(
            self.subject(&format!("CONSUMER.MSG.NEXT.{stream}.{consumer}")),
            pull,
        ))
    }
}

/// What a message arriving on a pull (or push) consumer's inbox is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Inbound<'a> {
    /// A stream message; ack it on `reply`.
    Message,
    /// 404: no messages (a `no_wait` pull found nothing).
    NoMessages,
    /// 408: the pull request expired; what it still had outstanding.
    RequestTimeout {
        pending_messages: Option<u64>,
        pending_bytes: Option<u64>,
    },
    /// 409: the pull ended for the reason given, e.g. "Consumer Deleted",
    /// "Exceeded MaxWaiting", "Message Size Exceeds MaxBytes", "Batch Completed",
    /// "Leadership Change", "Server Shutdown".
    Conflict { description: &'a str },
    /// 100 idle heartbeat; a push consumer's carries the last sequences it sent and may
    /// name a subject to answer when the consumer is stalled on flow control.
    IdleHeartbeat {
        last_consumer_seq: Option<u64>,
        last_stream_seq: Option<u64>,
        stalled_reply: Option<&'a str>,
    },
    /// 100 flow control request: publish an empty message to `reply`.
    FlowControl { reply: &'a str },
    /// Another status (400 bad request, 503...) with its description.
    Status { code: u16, description: &'a str },
}

impl Inbound<'_> {
    /// True when no more deliveries will come for the pull request that got this.
    pub fn ends_pull(&self) -> bool {
        matches!(
            self,
            Inbound::NoMessages
                | Inbound::RequestTimeout { .. }
                | Inbound::Conflict { .. }
                | Inbound::Status { .. }
        )
    }
}

fn num(s: Option<&str>) -> Option<u64> {
    s.and_then(|v| v.trim().parse().ok())
}

/// Classifies an inbound message of a pull or push consumer.
pub fn classify<'a>(msg: &Delivery<'a>) -> Inbound<'a> {
    let Some(code) = msg.status() else {
        return Inbound::Message;
    };
    let description = msg.description().unwrap_or_default();
    match code {
        404 => Inbound::NoMessages,
        408 => Inbound::RequestTimeout {
            pending_messages: num(msg.header("Nats-Pending-Messages")),
            pending_bytes: num(msg.header("Nats-Pending-Bytes")),
        },
        409 => Inbound::Conflict { description },
        100 => match msg.reply {
            // Only flow-control requests have a reply subject; heartbeats do not.
            Some(reply) if !reply.is_empty() && !description.contains("Idle") => {
                Inbound::FlowControl { reply }
            }
            _ => Inbound::IdleHeartbeat {
                last_consumer_seq: num(msg.header("Nats-Last-Consumer")),
                last_stream_seq: num(msg.header("Nats-Last-Stream")),
                stalled_reply: msg
                    .header("Nats-Consumer-Stalled")
                    .filter(|s| !s.is_empty()),
            },
        },
        code => Inbound::Status { code, description },
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::proto::headers::HeaderMap;

    fn status(code: u16, desc: &str, fields: &[(&str, &str)]) -> HeaderMap {
        let mut h = HeaderMap::with_status(code, desc).expect("status");
        for (n, v) in fields {
            h.insert(n, v).expect("field");
        }
        h
    }

    fn delivery<'a>(h: Option<&'a HeaderMap>, reply: Option<&'a str>) -> Delivery<'a> {
        Delivery {
            subject: "_INBOX.x",
            reply,
            headers: h,
            payload: b"",
        }
    }

    #[test]
    fn pull_request_body_has_only_what_is_set() {
        let api = ApiPrefix::new();
        let r = api
            .pull_next(
                "S",
                "C",
                &PullRequest {
                    batch: 10,
                    expires: Some(Duration::from_secs(5)),
                    no_wait: false,
                    max_bytes: Some(1024),
                    idle_heartbeat: Some(Duration::from_secs(1)),
                },
            )
            .expect("req");
        assert_eq!(r.subject, "$JS.API.CONSUMER.MSG.NEXT.S.C");
        assert_eq!(
            r.payload,
            br#"{"batch":10,"expires":5000000000,"max_bytes":1024,"idle_heartbeat":1000000000}"#
        );
        let nw = PullRequest {
            no_wait: true,
            ..PullRequest::batch(1)
        };
        let r = api.pull_next("S", "C", &nw).expect("req");
        assert_eq!(r.payload, br#"{"batch":1,"no_wait":true}"#);
        assert!(api.pull_next("S", "C", &PullRequest::batch(0)).is_err());
        let bad_hb = PullRequest {
            expires: Some(Duration::from_secs(1)),
            idle_heartbeat: Some(Duration::from_secs(2)),
            ..PullRequest::batch(1)
        };
        assert!(api.pull_next("S", "C", &bad_hb).is_err());
    }

    #[test]
    fn statuses_are_classified() {
        let plain = delivery(None, Some("$JS.ACK.S.C.1.1.1.1.0"));
        assert_eq!(classify(&plain), Inbound::Message);
        let h = status(404, "No Messages", &[]);
        assert_eq!(classify(&delivery(Some(&h), None)), Inbound::NoMessages);
        let h = status(
            408,
            "Request Timeout",
            &[("Nats-Pending-Messages", "3"), ("Nats-Pending-Bytes", "99")],
        );
        assert_eq!(
            classify(&delivery(Some(&h), None)),
            Inbound::RequestTimeout {
                pending_messages: Some(3),
                pending_bytes: Some(99)
            }
        );
        let h = status(409, "Consumer Deleted", &[]);
        let c = classify(&delivery(Some(&h), None));
        assert_eq!(
            c,
            Inbound::Conflict {
                description: "Consumer Deleted"
            }
        );
        assert!(c.ends_pull());
        let h = status(
            100,
            "Idle Heartbeat",
            &[("Nats-Last-Consumer", "7"), ("Nats-Last-Stream", "9")],
        );
        let hb = classify(&delivery(Some(&h), None));
        assert_eq!(
            hb,
            Inbound::IdleHeartbeat {
                last_consumer_seq: Some(7),
                last_stream_seq: Some(9),
                stalled_reply: None
            }
        );
        assert!(!hb.ends_pull());
        let h = status(100, "FlowControl Request", &[]);
        assert_eq!(
            classify(&delivery(Some(&h), Some("$JS.FC.S.x.y"))),
            Inbound::FlowControl {
                reply: "$JS.FC.S.x.y"
            }
        );
        let h = status(400, "Bad Request", &[]);
        assert_eq!(
            classify(&delivery(Some(&h), None)),
            Inbound::Status {
                code: 400,
                description: "Bad Request"
            }
        );
    }
}
