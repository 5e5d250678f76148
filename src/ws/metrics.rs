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
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LabelledHistogramId(usize);

/// Upper bounds (seconds) of NATS round-trip buckets: a local JetStream answers in
/// tenths of a millisecond to a few milliseconds, a struggling one in seconds.
pub const ROUND_TRIP_BUCKETS: [f64; 15] = [
    0.000_1, 0.000_25, 0.000_5, 0.001, 0.002_5, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
    5.0,
];

#[derive(Debug)]
enum Values {
    Scalar {
        label: Option<&'static str>,
        series: Vec<(String, f64)>,
    },
    /// `counts[i]`: the observations in bucket `i` alone (above `bounds[i - 1]`), made
    /// cumulative when rendered (see [`bucket`]).
    Histogram {
        bounds: &'static [f64],
        counts: Vec<u64>,
        sum: f64,
        count: u64,
    },
    /// One histogram per value of a label fixed at registration, so an observation is an
    /// index and a few additions, never a lookup or an allocation.
    LabelledHistogram {
        label: &'static str,
        label_values: &'static [&'static str],
        bounds: &'static [f64],
        /// `label_values.len() * bounds.len()` bucket counts, one row per label value,
        /// each bucket's alone as in `Histogram`.
        counts: Vec<u64>,
        sums: Vec<f64>,
        totals: Vec<u64>,
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

    /// A histogram per value of `label`; observations name the value by its index.
    pub fn labelled_histogram(
        &mut self,
        name: &'static str,
        help: &'static str,
        label: &'static str,
        label_values: &'static [&'static str],
        bounds: &'static [f64],
    ) -> LabelledHistogramId {
        self.families.push(Family {
            name,
            help,
            kind: "histogram",
            values: Values::LabelledHistogram {
                label,
                label_values,
                bounds,
                counts: vec![0; label_values.len() * bounds.len()],
                sums: vec![0.0; label_values.len()],
                totals: vec![0; label_values.len()],
            },
        });
        LabelledHistogramId(self.families.len() - 1)
    }

    /// Records one observation under `label_values[index]`; an index out of range is ignored.
    pub fn observe_at(&mut self, id: LabelledHistogramId, index: usize, value: f64) {
        let Some(Family {
            values:
                Values::LabelledHistogram {
                    label_values,
                    bounds,
                    counts,
                    sums,
                    totals,
                    ..
                },
            ..
        }) = self.families.get_mut(id.0)
        else {
            return;
        };
        if index >= label_values.len() {
            return;
        }
        if let Some(c) =
            bucket(bounds, value).and_then(|b| counts.get_mut(index * bounds.len() + b))
        {
            *c += 1;
        }
        if let Some(sum) = sums.get_mut(index) {
            *sum += value;
        }
        if let Some(total) = totals.get_mut(index) {
            *total += 1;
        }
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
            if let Some(c) = bucket(bounds, value).and_then(|b| counts.get_mut(b)) {
                *c += 1;
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
                Values::LabelledHistogram {
                    label_values,
                    totals,
                    ..
                } => label_values
                    .iter()
                    .position(|v| *v == label_value)
                    .and_then(|i| totals.get(i))
                    .map(|t| *t as f64),
            })
    }

    fn slot(&mut self, family: usize, label_value: &str) -> Option<&mut f64> {
        let at = self.slot_index(family, label_value)?;
        self.slot_at(family, at)
    }

    fn slot_at(&mut self, family: usize, at: usize) -> Option<&mut f64> {
        match &mut self.families.get_mut(family)?.values {
            Values::Scalar { series, .. } => series.get_mut(at).map(|(_, v)| v),
            _ => None,
        }
    }

    /// Where `label_value`'s series is in a scalar family, made if need be.
    fn slot_index(&mut self, family: usize, label_value: &str) -> Option<usize> {
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
        Some(at)
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
                    for (bound, c) in bounds.iter().zip(cumulative(counts)) {
                        let _ = writeln!(out, "{}_bucket{{le=\"{bound}\"}} {c}", f.name);
                    }
                    let _ = writeln!(out, "{}_bucket{{le=\"+Inf\"}} {count}", f.name);
                    let _ = writeln!(out, "{}_sum {sum}", f.name);
                    let _ = writeln!(out, "{}_count {count}", f.name);
                }
                Values::LabelledHistogram {
                    label,
                    label_values,
                    bounds,
                    counts,
                    sums,
                    totals,
                } => {
                    let name = f.name;
                    for (i, value) in label_values.iter().enumerate() {
                        let row = counts.get(i * bounds.len()..).unwrap_or_default();
                        for (bound, c) in bounds.iter().zip(cumulative(row)) {
                            let _ = writeln!(
                                out,
                                "{name}_bucket{{{label}=\"{value}\",le=\"{bound}\"}} {c}"
                            );
                        }
                        let total = totals.get(i).copied().unwrap_or(0);
                        let sum = sums.get(i).copied().unwrap_or(0.0);
                        let _ = writeln!(
                            out,
                            "{name}_bucket{{{label}=\"{value}\",le=\"+Inf\"}} {total}"
                        );
                        let _ = writeln!(out, "{name}_sum{{{label}=\"{value}\"}} {sum}");
                        let _ = writeln!(out, "{name}_count{{{label}=\"{value}\"}} {total}");
                    }
                }
            }
        }
    }
}

/// The bucket an observation counts in: the first whose bound it is at or under (none
/// for one above them all, or NaN), found from the smallest, where latencies are. One
/// count a bucket, not one in every bucket from there up: an observation is a few
/// comparisons, not one per bound, and the rendering adds them up.
fn bucket(bounds: &[f64], value: f64) -> Option<usize> {
    bounds.iter().position(|&bound| value <= bound)
}

/// The running totals of per-bucket counts: Prometheus's cumulative `le` buckets.
fn cumulative(counts: &[u64]) -> impl Iterator<Item = u64> + '_ {
    counts.iter().scan(0u64, |total, &c| {
        *total += c;
        Some(*total)
    })
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

/// Where the series of one labelled counter are, found once for each of a fixed set of
/// label values the caller numbers (an enum's variants): a count is then an index, not
/// a comparison with each label value the family has (every frame in and out is
/// counted, by op). The caller gives each number one label value, always the same.
#[derive(Debug)]
pub struct SeriesCache<const N: usize> {
    id: CounterId,
    found: [Option<usize>; N],
}

impl<const N: usize> SeriesCache<N> {
    pub fn new(id: CounterId) -> Self {
        SeriesCache {
            id,
            found: [None; N],
        }
    }

    /// [`Registry::add`] of `n` to `label_value`, the caller's label number `index`
    /// (one past the set is counted as `add` counts it, and not kept).
    pub fn add(&mut self, registry: &mut Registry, index: usize, label_value: &str, n: f64) {
        let found = match self.found.get(index).copied().flatten() {
            Some(at) => Some(at),
            None => registry.slot_index(self.id.0, label_value).inspect(|&at| {
                if let Some(f) = self.found.get_mut(index) {
                    *f = Some(at);
                }
            }),
        };
        if let Some(v) = found.and_then(|at| registry.slot_at(self.id.0, at)) {
            *v += n;
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
    /// NATS request round trips, in seconds, by [`NatsOp`].
    pub nats_request_seconds: LabelledHistogramId,
    pub nats_reconnects: CounterId,
    /// Messages of the ingress connection dropped while the main one was down.
    pub nats_ingress_dropped: CounterId,
    /// NATS messages dropped for an invalid subject or reply subject.
    pub nats_invalid_messages: CounterId,
    /// `-ERR`s after which the server kept the connection (a permissions violation).
    pub nats_server_errors: CounterId,
    /// NATS replies and messages no part of the broker was waiting for, by `kind`.
    pub nats_unmatched: CounterId,
    /// Auth callout requests, by `outcome`.
    pub callout_requests: CounterId,
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
        let nats_request_seconds = r.labelled_histogram(
            "amp_nats_request_duration_seconds",
            "Round trip of the broker's NATS requests, by the kind of operation.",
            "op",
            &NatsOp::LABELS,
            &ROUND_TRIP_BUCKETS,
        );
        let nats_reconnects = r.counter(
            "amp_nats_reconnects_total",
            "Reconnections to the NATS server.",
            None,
        );
        let nats_ingress_dropped = r.counter(
            "amp_nats_ingress_dropped_total",
            "MIG and auth callout requests dropped unread because the NATS connection that answers them was down.",
            None,
        );
        let nats_invalid_messages = r.counter(
            "amp_nats_invalid_messages_total",
            "NATS messages dropped because their subject or reply subject is invalid.",
            None,
        );
        let nats_server_errors = r.counter(
            "amp_nats_server_errors_total",
            "NATS server errors after which the server kept the connection (permissions violations).",
            None,
        );
        let nats_unmatched = r.counter(
            "amp_nats_unmatched_total",
            "NATS replies and messages nothing in the broker was waiting for (late, or for a subscription already gone), by kind.",
            Some("kind"),
        );
        let callout_requests = r.counter(
            "amp_callout_requests_total",
            "Auth callout requests, by outcome (authorized, refused, throttled, bad, shed).",
            Some("outcome"),
        );
        // Their label values are a known few: each starts at 0, so a rate or an alert on
        // one works before its first event.
        for kind in ["message", "reply"] {
            r.add(nats_unmatched, kind, 0.0);
        }
        for outcome in ["authorized", "refused", "throttled", "bad", "shed"] {
            r.add(callout_requests, outcome, 0.0);
        }
        AmpMetrics {
            registry: r,
            frames_in,
            frames_out,
            errors,
            sessions,
            js_request_seconds,
            nats_request_seconds,
            nats_reconnects,
            nats_ingress_dropped,
            nats_invalid_messages,
            nats_server_errors,
            nats_unmatched,
            callout_requests,
        }
    }
}

/// The kinds of NATS request the broker makes, the `op` label of
/// `amp_nats_request_duration_seconds`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NatsOp {
    StreamPublish,
    AckSync,
    ConsumerCreate,
    ConsumerInfo,
    ConsumerDelete,
    ConsumerList,
    KvGet,
    KvPut,
    StreamMsgDelete,
    StreamMsgGet,
    StreamInfo,
    StreamCreate,
    StreamUpdate,
}

impl NatsOp {
    /// Label values, indexed by the variant's position.
    pub const LABELS: [&'static str; 13] = [
        "stream_publish",
        "ack_sync",
        "consumer_create",
        "consumer_info",
        "consumer_delete",
        "consumer_list",
        "kv_get",
        "kv_put",
        "stream_msg_delete",
        "stream_msg_get",
        "stream_info",
        "stream_create",
        "stream_update",
    ];

    pub const fn index(self) -> usize {
        self as usize
    }

    pub const fn label(self) -> &'static str {
        Self::LABELS[self as usize]
    }
}

/// `amp_build_info`: the version from Cargo and the commit recorded by `build.rs`.
pub fn render_build_info(out: &mut String) {
    out.push_str(
        "# HELP amp_build_info The broker's version and the git commit it was built from.\n",
    );
    out.push_str("# TYPE amp_build_info gauge\n");
    let _ = writeln!(
        out,
        "amp_build_info{{version=\"{}\",git_commit=\"{}\"}} 1",
        env!("CARGO_PKG_VERSION"),
        env!("AMP_GIT_COMMIT")
    );
}

/// How long a reading of `/proc/self` serves `/metrics`: the descriptor count walks a
/// directory of every open descriptor, and `/metrics` needs no credential, so a scrape
/// storm reads it at most once a second.
const PROCESS_READING_TTL: std::time::Duration = std::time::Duration::from_secs(1);

thread_local! {
    static PROCESS_READING: std::cell::RefCell<Option<(std::time::Instant, String)>> =
        const { std::cell::RefCell::new(None) };
}

/// The standard `process_*` families, read from `/proc/self` at most once a second (see
/// `PROCESS_READING_TTL`); a family whose source cannot be read is left out rather than
/// reported as zero.
pub fn render_process(out: &mut String) {
    let now = std::time::Instant::now();
    PROCESS_READING.with_borrow_mut(|reading| {
        let fresh = reading
            .as_ref()
            .is_some_and(|(at, _)| now.saturating_duration_since(*at) < PROCESS_READING_TTL);
        if !fresh {
            let mut text = String::new();
            read_process(&mut text);
            *reading = Some((now, text));
        }
        if let Some((_, text)) = reading {
            out.push_str(text);
        }
    });
}

fn read_process(out: &mut String) {
    if let Some(rss) = process::resident_bytes() {
        out.push_str("# HELP process_resident_memory_bytes Resident memory size in bytes.\n");
        let _ = writeln!(
            out,
            "# TYPE process_resident_memory_bytes gauge\nprocess_resident_memory_bytes {rss}"
        );
    }
    if let Some(cpu) = process::cpu_seconds() {
        out.push_str(
            "# HELP process_cpu_seconds_total Total user and system CPU time spent in seconds.\n",
        );
        let _ = writeln!(
            out,
            "# TYPE process_cpu_seconds_total counter\nprocess_cpu_seconds_total {cpu}"
        );
    }
    if let Some(fds) = process::open_fds() {
        out.push_str("# HELP process_open_fds Number of open file descriptors.\n");
        let _ = writeln!(out, "# TYPE process_open_fds gauge\nprocess_open_fds {fds}");
    }
}

#[cfg(target_os = "linux")]
mod process {
    /// `VmRSS` of `/proc/self/status`, which is in kB whatever the page size.
    pub fn resident_bytes() -> Option<u64> {
        let status = std::fs::read_to_string("/proc/self/status").ok()?;
        let line = status.lines().find(|l| l.starts_with("VmRSS:"))?;
        let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
        Some(kb.saturating_mul(1024))
    }

    /// `utime + stime` of `/proc/self/stat`, in clock ticks.
    pub fn cpu_seconds() -> Option<f64> {
        let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
        // The command name may hold spaces and parentheses; the fields follow the last ')'.
        let (_, rest) = stat.rsplit_once(')')?;
        let mut fields = rest.split_whitespace();
        // After ')' come state (field 3) .. ; utime and stime are fields 14 and 15.
        let utime: u64 = fields.nth(11)?.parse().ok()?;
        let stime: u64 = fields.next()?.parse().ok()?;
        // SAFETY: sysconf has no preconditions; it only reads a system constant.
        let ticks = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
        (ticks > 0).then(|| utime.saturating_add(stime) as f64 / ticks as f64)
    }

    pub fn open_fds() -> Option<u64> {
        let dir = std::fs::read_dir("/proc/self/fd").ok()?;
        // The directory's own descriptor, open while it is read, is not the process's.
        Some((dir.count() as u64).saturating_sub(1))
    }
}

#[cfg(not(target_os = "linux"))]
mod process {
    pub fn resident_bytes() -> Option<u64> {
        None
    }
    pub fn cpu_seconds() -> Option<f64> {
        None
    }
    pub fn open_fds() -> Option<u64> {
        None
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
    fn a_series_cache_counts_what_add_counts() {
        let (mut cached, mut plain) = (Registry::new(), Registry::new());
        let (a, b) = (
            cached.counter("t_total", "t", Some("op")),
            plain.counter("t_total", "t", Some("op")),
        );
        let mut cache: SeriesCache<3> = SeriesCache::new(a);
        // The last label is past the cache's set; later rounds find the family full,
        // so new values fold into `other`.
        let labels = ["x", "y", "z", "w"];
        for round in 0..3 {
            for (i, label) in labels.iter().enumerate() {
                cache.add(&mut cached, i, label, 1.0 + i as f64);
                plain.add(b, label, 1.0 + i as f64);
            }
            for k in 0..MAX_SERIES {
                let label = format!("r{round}-{k}");
                cached.inc(a, &label);
                plain.inc(b, &label);
            }
        }
        let (mut want, mut got) = (String::new(), String::new());
        plain.render(&mut want);
        cached.render(&mut got);
        assert_eq!(got, want);
        assert!(got.contains("t_total{op=\"z\"} 9\n"), "{got}");
        assert!(got.contains("t_total{op=\"other\"}"), "{got}");
    }

    #[test]
    fn families_of_a_known_few_label_values_start_with_each_at_zero() {
        let m = AmpMetrics::new();
        let mut out = String::new();
        m.registry.render(&mut out);
        for series in [
            "amp_nats_unmatched_total{kind=\"reply\"} 0\n",
            "amp_callout_requests_total{outcome=\"throttled\"} 0\n",
            "amp_callout_requests_total{outcome=\"shed\"} 0\n",
        ] {
            assert!(out.contains(series), "{series} in {out}");
        }
    }

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
    fn histograms_render_what_a_count_in_every_bucket_from_the_values_up_did() {
        // The old observation, the oracle: one count in every bucket at or above it.
        fn old_observe(bounds: &[f64], counts: &mut [u64], value: f64) {
            for (bound, c) in bounds.iter().zip(counts.iter_mut()) {
                if value <= *bound {
                    *c += 1;
                }
            }
        }
        for bounds in [&LATENCY_BUCKETS[..], &ROUND_TRIP_BUCKETS[..]] {
            // As the format requires, and as `bucket` and `cumulative` assume.
            assert!(bounds.windows(2).all(|w| w[0] < w[1]), "{bounds:?}");
        }
        let mut values = vec![f64::NAN, f64::INFINITY, f64::NEG_INFINITY, -1.0, 0.0, 100.0];
        for &b in LATENCY_BUCKETS.iter().chain(&ROUND_TRIP_BUCKETS) {
            values.extend([b, b * 0.999_999, b * 1.000_001]);
        }
        let mut state = 0x2545_f491_4f6c_dd1d_u64;
        for _ in 0..5_000 {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            let unit = (state >> 11) as f64 / (1u64 << 53) as f64;
            values.push(unit * 10f64.powi((state % 7) as i32 - 4));
        }
        let mut m = AmpMetrics::new();
        let mut old_js = [0u64; LATENCY_BUCKETS.len()];
        let mut old_nats = vec![[0u64; ROUND_TRIP_BUCKETS.len()]; NatsOp::LABELS.len()];
        for (i, &v) in values.iter().enumerate() {
            m.registry.observe(m.js_request_seconds, v);
            old_observe(&LATENCY_BUCKETS, &mut old_js, v);
            let op = i % NatsOp::LABELS.len();
            m.registry.observe_at(m.nats_request_seconds, op, v);
            old_observe(&ROUND_TRIP_BUCKETS, &mut old_nats[op], v);
        }
        let mut out = String::new();
        m.registry.render(&mut out);
        let mut expected = Vec::new();
        for (bound, c) in LATENCY_BUCKETS.iter().zip(old_js) {
            expected.push(format!(
                "amp_jetstream_request_seconds_bucket{{le=\"{bound}\"}} {c}\n"
            ));
        }
        let name = "amp_nats_request_duration_seconds";
        for (op, counts) in NatsOp::LABELS.iter().zip(&old_nats) {
            for (bound, c) in ROUND_TRIP_BUCKETS.iter().zip(counts) {
                expected.push(format!("{name}_bucket{{op=\"{op}\",le=\"{bound}\"}} {c}\n"));
            }
        }
        for line in expected {
            assert!(out.contains(&line), "{line:?} not in\n{out}");
        }
    }

    #[test]
    fn labelled_histograms_keep_one_series_per_value() {
        let mut m = AmpMetrics::new();
        let id = m.nats_request_seconds;
        m.registry.observe_at(id, NatsOp::KvGet.index(), 0.000_3);
        m.registry.observe_at(id, NatsOp::KvGet.index(), 0.02);
        m.registry
            .observe_at(id, NatsOp::StreamPublish.index(), 0.001);
        m.registry.observe_at(id, NatsOp::LABELS.len(), 1.0);
        let mut out = String::new();
        m.registry.render(&mut out);
        let name = "amp_nats_request_duration_seconds";
        assert!(out.contains(&format!("{name}_bucket{{op=\"kv_get\",le=\"0.0001\"}} 0\n")));
        assert!(out.contains(&format!("{name}_bucket{{op=\"kv_get\",le=\"0.0005\"}} 1\n")));
        assert!(out.contains(&format!("{name}_bucket{{op=\"kv_get\",le=\"0.025\"}} 2\n")));
        assert!(out.contains(&format!("{name}_count{{op=\"kv_get\"}} 2\n")));
        assert!(out.contains(&format!(
            "{name}_bucket{{op=\"stream_publish\",le=\"0.001\"}} 1\n"
        )));
        assert!(out.contains(&format!("{name}_count{{op=\"consumer_list\"}} 0\n")));
        assert_eq!(m.registry.value(name, NatsOp::KvGet.label()), Some(2.0));
    }

    #[test]
    fn build_info_and_process_families_render() {
        let mut out = String::new();
        render_build_info(&mut out);
        assert!(out.contains(&format!(
            "amp_build_info{{version=\"{}\",git_commit=\"",
            env!("CARGO_PKG_VERSION")
        )));
        render_process(&mut out);
        if cfg!(target_os = "linux") {
            assert!(out.contains("\nprocess_resident_memory_bytes "));
            assert!(out.contains("\nprocess_cpu_seconds_total "));
            assert!(out.contains("\nprocess_open_fds "));
        }
    }

    #[test]
    fn process_families_are_read_at_most_once_a_second() {
        // The descriptor count walks every open descriptor; `/metrics` asked as fast as
        // clients could ask walked it each time, on the loop's thread.
        let (mut first, mut second) = (String::new(), String::new());
        render_process(&mut first);
        let more: Vec<std::fs::File> = (0..16)
            .filter_map(|_| std::fs::File::open("/proc/self/status").ok())
            .collect();
        render_process(&mut second);
        assert_eq!(first, second, "read again within the second");
        drop(more);
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
