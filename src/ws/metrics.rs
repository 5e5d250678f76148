//! A small Prometheus registry: counters and gauges with at most one label, and
//! unlabelled histograms, rendered in the text exposition format (0.0.4).
//!
//! Label values are bounded per family ([`MAX_SERIES`]); values past the bound are
//! counted under `other`, so a client cannot grow the registry.

use std::fmt::Write as _;

/// Most distinct label values one family keeps before folding the rest into `other`.
pub const MAX_SERIES: usize = 64;

/// Upper bounds (seconds) of the default latency histogram buckets.
pub const LATENCY_BUCKETS: [f64; 14] = [
    0.000_5, 0.001, 0.002_5, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
];

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CounterId(usize);
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GaugeId(usize);
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HistogramId(usize);

#[derive(Debug)]
enum Values {
    Scalar {
        label: Option<&'static str>,
        series: Vec<(String, f64)>,
    },
    Histogram {
        bounds: &'static [f64],
        counts: Vec<u64>,
        sum: f64,
        count: u64,
    },
}

#[derive(Debug)]
struct Family {
    name: &'static str,
    help: &'static str,
    kind: &'static str,
    values: Values,
}

#[derive(Debug, Default)]
pub struct Registry {
    families: Vec<Family>,
}

impl Registry {
    pub fn new() -> Self {
        Registry::default()
    }

    /// A counter family; `label` names its one label, if any.
    pub fn counter(
        &mut self,
        name: &'static str,
        help: &'static str,
        label: Option<&'static str>,
    ) -> CounterId {
        CounterId(self.scalar(name, help, "counter", label))
    }

    pub fn gauge(
        &mut self,
        name: &'static str,
        help: &'static str,
        label: Option<&'static str>,
    ) -> GaugeId {
        GaugeId(self.scalar(name, help, "gauge", label))
    }

    pub fn histogram(
        &mut self,
        name: &'static str,
        help: &'static str,
        bounds: &'static [f64],
    ) -> HistogramId {
        self.families.push(Family {
            name,
            help,
            kind: "histogram",
            values: Values::Histogram {
                bounds,
                counts: vec![0; bounds.len()],
                sum: 0.0,
                count: 0,
            },
        });
        HistogramId(self.families.len() - 1)
    }

    fn scalar(
        &mut self,
        name: &'static str,
        help: &'static str,
        kind: &'static str,
        label: Option<&'static str>,
    ) -> usize {
        self.families.push(Family {
            name,
            help,
            kind,
            values: Values::Scalar {
                label,
                series: Vec::new(),
            },
        });
        self.families.len() - 1
    }

    /// Adds one to the series `label_value` (ignored for an unlabelled family).
    pub fn inc(&mut self, id: CounterId, label_value: &str) {
        self.add(id, label_value, 1.0);
    }

    pub fn add(&mut self, id: CounterId, label_value: &str, n: f64) {
        if let Some(v) = self.slot(id.0, label_value) {
            *v += n;
        }
    }

    pub fn set(&mut self, id: GaugeId, label_value: &str, value: f64) {
        if let Some(v) = self.slot(id.0, label_value) {
            *v = value;
        }
    }

    pub fn gauge_add(&mut self, id: GaugeId, label_value: &str, delta: f64) {
        if let Some(v) = self.slot(id.0, label_value) {
            *v += delta;
        }
    }

    /// Records one observation (seconds for latency histograms).
    pub fn observe(&mut self, id: HistogramId, value: f64) {
        if let Some(Family {
            values:
                Values::Histogram {
                    bounds,
                    counts,
                    sum,
                    count,
                },
            ..
        }) = self.families.get_mut(id.0)
        {
            for (bound, c) in bounds.iter().zip(counts.iter_mut()) {
                if value <= *bound {
                    *c += 1;
                }
            }
            *sum += value;
            *count += 1;
        }
    }

    /// Current value of one series, for tests and health decisions.
    pub fn value(&self, family: &str, label_value: &str) -> Option<f64> {
        self.families
            .iter()
            .find(|f| f.name == family)
            .and_then(|f| match &f.values {
                Values::Scalar { series, .. } => series
                    .iter()
                    .find(|(l, _)| l == label_value)
                    .map(|(_, v)| *v),
                Values::Histogram { count, .. } => Some(*count as f64),
            })
    }

    fn slot(&mut self, family: usize, label_value: &str) -> Option<&mut f64> {
        let Values::Scalar { label, series } = &mut self.families.get_mut(family)?.values else {
            return None;
        };
        let key = if label.is_none() { "" } else { label_value };
        let at = match series.iter().position(|(l, _)| l == key) {
            Some(at) => at,
            None if series.len() < MAX_SERIES => {
                series.push((key.to_owned(), 0.0));
                series.len() - 1
            }
            None => match series.iter().position(|(l, _)| l == "other") {
                Some(at) => at,
                None => {
                    // The last slot becomes `other`, keeping the bound exact.
                    series.push(("other".to_owned(), 0.0));
                    series.len() - 1
                }
            },
        };
        series.get_mut(at).map(|(_, v)| v)
    }

    /// Appends the text exposition of every family to `out`.
    pub fn render(&self, out: &mut String) {
        for f in &self.families {
            let _ = writeln!(out, "# HELP {} {}", f.name, f.help);
            let _ = writeln!(out, "# TYPE {} {}", f.name, f.kind);
            match &f.values {
                Values::Scalar {
                    label: None,
                    series,
                } => {
                    let v = series.first().map_or(0.0, |(_, v)| *v);
                    let _ = writeln!(out, "{} {}", f.name, v);
                }
                Values::Scalar {
                    label: Some(label),
                    series,
                } => {
                    for (value, v) in series {
                        let _ = write!(out, "{}{{{}=\"", f.name, label);
                        escape_label(out, value);
                        let _ = writeln!(out, "\"}} {v}");
                    }
                }
                Values::Histogram {
                    bounds,
                    counts,
                    sum,
                    count,
                } => {
                    for (bound, c) in bounds.iter().zip(counts) {
                        let _ = writeln!(out, "{}_bucket{{le=\"{bound}\"}} {c}", f.name);
                    }
                    let _ = writeln!(out, "{}_bucket{{le=\"+Inf\"}} {count}", f.name);
                    let _ = writeln!(out, "{}_sum {sum}", f.name);
                    let _ = writeln!(out, "{}_count {count}", f.name);
                }
            }
        }
    }
}

fn escape_label(out: &mut String, value: &str) {
    for c in value.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '"' => out.push_str("\\\""),
            '\n' => out.push_str("\\n"),
            c => out.push(c),
        }
    }
}

/// The broker's standard `amp_` families, registered in one place so names stay stable.
#[derive(Debug)]
pub struct AmpMetrics {
    pub registry: Registry,
    /// Client frames received, by `op` (`unknown` for frames without a known op).
    pub frames_in: CounterId,
    /// Frames sent, by `op`.
    pub frames_out: CounterId,
    /// Error replies sent, by `code`.
    pub errors: CounterId,
    /// Authenticated sessions open now.
    pub sessions: GaugeId,
    /// JetStream API request round trips, in seconds.
    pub js_request_seconds: HistogramId,
    pub nats_reconnects: CounterId,
    /// NATS messages dropped for an invalid subject or reply subject.
    pub nats_invalid_messages: CounterId,
}

impl AmpMetrics {
    pub fn new() -> Self {
        let mut r = Registry::new();
        let frames_in = r.counter(
            "amp_frames_in_total",
            "Client frames received, by op.",
            Some("op"),
        );
        let frames_out = r.counter(
            "amp_frames_out_total",
            "Frames sent to clients, by op.",
            Some("op"),
        );
        let errors = r.counter(
            "amp_errors_total",
            "Error replies sent, by code.",
            Some("code"),
        );
        let sessions = r.gauge("amp_sessions", "Authenticated AMP sessions open.", None);
        let js_request_seconds = r.histogram(
            "amp_jetstream_request_seconds",
            "Round trip of JetStream API requests.",
            &LATENCY_BUCKETS,
        );
        let nats_reconnects = r.counter(
            "amp_nats_reconnects_total",
            "Reconnections to the NATS server.",
            None,
        );
        let nats_invalid_messages = r.counter(
            "amp_nats_invalid_messages_total",
            "NATS messages dropped because their subject or reply subject is invalid.",
            None,
        );
        AmpMetrics {
            registry: r,
            frames_in,
            frames_out,
            errors,
            sessions,
            js_request_seconds,
            nats_reconnects,
            nats_invalid_messages,
        }
    }
}

impl Default for AmpMetrics {
    fn default() -> Self {
        AmpMetrics::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_labelled_counters_gauges_and_histograms() {
        let mut m = AmpMetrics::new();
        m.registry.inc(m.frames_in, "send");
        m.registry.inc(m.frames_in, "send");
        m.registry.inc(m.frames_in, "ack");
        m.registry.inc(m.errors, "sch\"ema");
        m.registry.set(m.sessions, "", 3.0);
        m.registry.observe(m.js_request_seconds, 0.003);
        m.registry.observe(m.js_request_seconds, 20.0);
        let mut out = String::new();
        m.registry.render(&mut out);
        assert!(out.contains("# TYPE amp_frames_in_total counter\n"));
        assert!(out.contains("amp_frames_in_total{op=\"send\"} 2\n"));
        assert!(out.contains("amp_frames_in_total{op=\"ack\"} 1\n"));
        assert!(out.contains("amp_errors_total{code=\"sch\\\"ema\"} 1\n"));
        assert!(out.contains("amp_sessions 3\n"));
        assert!(out.contains("amp_nats_reconnects_total 0\n"));
        assert!(out.contains("amp_jetstream_request_seconds_bucket{le=\"0.0025\"} 0\n"));
        assert!(out.contains("amp_jetstream_request_seconds_bucket{le=\"0.005\"} 1\n"));
        assert!(out.contains("amp_jetstream_request_seconds_bucket{le=\"+Inf\"} 2\n"));
        assert!(out.contains("amp_jetstream_request_seconds_count 2\n"));
    }

    #[test]
    fn label_values_past_the_bound_fold_into_other() {
        let mut r = Registry::new();
        let c = r.counter("amp_x_total", "x", Some("op"));
        for i in 0..(MAX_SERIES + 10) {
            r.inc(c, &format!("v{i}"));
        }
        assert_eq!(r.value("amp_x_total", "v0"), Some(1.0));
        assert_eq!(r.value("amp_x_total", "other"), Some(10.0));
        let mut out = String::new();
        r.render(&mut out);
        assert_eq!(
            out.lines()
                .filter(|l| l.starts_with("amp_x_total{"))
                .count(),
            MAX_SERIES + 1
        );
    }
}
