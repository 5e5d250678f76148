//! Faults, chosen by the run's random stream at each step while faults are on.

use std::time::Duration;

use super::world::World;

impl World {
    /// With a small chance per step, one fault.
    pub fn maybe_fault(&mut self) {
        if !self.rng.chance(self.cfg.fault_per_mille) {
            return;
        }
        self.stats.faults += 1;
        let node = self.rng.index(self.nodes.len());
        let roll = self.rng.below(100);
        self.mix(&format!("fault {roll} {node}"));
        match roll {
            // The broker's NATS transport drops; its connection reconnects.
            0..20 => self.drop_nats(node),
            // The next 1-3 chunks the server sends this broker are lost (replies,
            // deliveries, pongs).
            20..40 => self.nodes[node].drop_chunks = self.rng.range(1, 3) as u32,
            // For a while everything from the server reaches this broker late: some past
            // the requests' deadlines (4 s), some just before.
            40..60 => {
                let window = Duration::from_millis(self.rng.range(100, 3000));
                let by = Duration::from_millis(self.rng.range(200, 6000));
                self.nodes[node].delay = Some((self.now + window, by));
                self.nodes[node].delayed_until_ms =
                    self.elapsed_ms() + (window + by).as_millis() as u64;
            }
            // The broker process dies and starts again with the same id.
            60..72 => self.crash(node),
            // nats-server restarts (its streams and consumers stay).
            72..77 => self.restart_server(),
            // The server's wall clock steps (stream timestamps).
            77..85 => {
                let by = Duration::from_millis(self.rng.range(1, 120_000));
                let forward = self.rng.chance(500);
                self.server.set_wall_clock_offset(by, forward);
            }
            // A client vanishes mid-operation.
            85..95 => {
                let c = self.rng.index(self.clients.len());
                if let Some(s) = self.clients[c].session {
                    self.close_session(s);
                    self.client_closed(c, s, None);
                }
            }
            // A client starts (or stops) reading slowly.
            _ => {
                let c = self.rng.index(self.clients.len());
                self.clients[c].slow = !self.clients[c].slow;
            }
        }
    }
}
