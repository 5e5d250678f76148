//! Identity: the NATS auth callout this broker answers for the participants it knows.

use super::*;

impl Broker {
    pub(super) fn answer_callout(&mut self, conn: &mut Connection, msg: &Message, now: Instant) {
        let (Some(callout), Some(reply_to)) = (self.callout.as_mut(), msg.reply.as_deref()) else {
            return;
        };
        if let Some(info) = conn.server_info() {
            callout.learn_server(&info.server_id);
        }
        let reply = callout.handle(
            &self.config,
            msg.headers.as_ref(),
            &msg.payload,
            now,
            self.clock.unix_seconds(now),
        );
        let outcome = match &reply.outcome {
            Outcome::Authorized { .. } => "authorized",
            Outcome::Refused { reason, .. } if reason == "throttled" => "throttled",
            Outcome::Refused { .. } => "refused",
            Outcome::BadRequest { .. } => "bad",
            Outcome::Shed => "shed",
        };
        self.metrics
            .registry
            .inc(self.metrics.callout_requests, outcome);
        match &reply.outcome {
            Outcome::Authorized { participant } => {
                log::info!(participant:% = participant; "auth callout authorized"
                )
            }
            // A throttled attempt is one of many (each NATS connect is a request): logged
            // at debug, so a connect loop does not write a line each.
            Outcome::Refused {
                participant,
                reason,
            } if reason == "throttled" => log::debug!(
                participant:% = participant.as_deref().unwrap_or("?");
                "auth callout refused: throttled"
            ),
            Outcome::Refused {
                participant,
                reason,
            } => log::info!(
                participant:% = participant.as_deref().unwrap_or("?"), reason:% = reason;
                "auth callout refused"
            ),
            // Counted; a line each would flood the log at the rate it protects against.
            Outcome::Shed => log::debug!("auth callout over its budget: empty reply"),
            Outcome::BadRequest { reason } => {
                log::warn!("auth callout ignored a bad request: {reason}")
            }
        }
        let _ = conn.publish(reply_to, None, None, &reply.payload);
    }
}
