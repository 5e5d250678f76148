//! The broker's log sink: a `log::Log` that writes one line per event to stderr, as text
//! (`2026-12-01T21:00:00.123Z INFO  session=b1-7 participant=acme/a hello`) or as one JSON
//! object per line (`{"ts":..,"level":..,"msg":..,"session":..}`). The ids an event concerns
//! travel as `log` key-values (`log::info!(session:% = s; "hello")`) so both formats carry
//! them as fields.

use std::fmt::Write as _;
use std::io::Write as _;
use std::time::SystemTime;

use log::kv::{Key, Value, VisitSource};
use log::{Level, LevelFilter, Log, Metadata, Record};

use crate::amp::reply::push_json_str;
use crate::rfc3339;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    Text,
    Json,
}

impl Format {
    pub fn parse(s: &str) -> Result<Format, String> {
        match s {
            "text" => Ok(Format::Text),
            "json" => Ok(Format::Json),
            _ => Err(format!("`{s}` is not a log format (text or json)")),
        }
    }
}

pub fn parse_level(s: &str) -> Result<LevelFilter, String> {
    match s {
        "error" => Ok(LevelFilter::Error),
        "warn" => Ok(LevelFilter::Warn),
        "info" => Ok(LevelFilter::Info),
        "debug" => Ok(LevelFilter::Debug),
        "trace" => Ok(LevelFilter::Trace),
        _ => Err(format!(
            "`{s}` is not a log level (error, warn, info, debug or trace)"
        )),
    }
}

/// Longest message kept; a longer one (an error quoting a peer's bytes) is cut so a hostile
/// input cannot make one log line arbitrarily large.
const MAX_MESSAGE: usize = 4096;

pub struct Sink {
    level: LevelFilter,
    format: Format,
}

impl Sink {
    pub fn new(level: LevelFilter, format: Format) -> Sink {
        Sink { level, format }
    }

    /// Dependencies (mio, rustls) log internals that say nothing to an operator; they
    /// are shown only at `trace`.
    fn wants(&self, metadata: &Metadata<'_>) -> bool {
        let ours = metadata.target().starts_with("amp_broker");
        let limit = if ours || self.level == LevelFilter::Trace {
            self.level
        } else {
            LevelFilter::Warn.min(self.level)
        };
        metadata.level() <= limit
    }

    /// The record as one line, newline included.
    pub fn line(&self, record: &Record<'_>, now: SystemTime) -> String {
        let ts = rfc3339::format_system_time(now);
        let mut msg = record.args().to_string();
        truncate(&mut msg, MAX_MESSAGE);
        let mut fields = Fields(Vec::new());
        // A visitor of ours never fails; a failing source only loses its fields.
        let _ = record.key_values().visit(&mut fields);
        let mut out = String::with_capacity(64 + msg.len());
        match self.format {
            Format::Text => {
                let _ = write!(out, "{ts} {:<5}", record.level());
                for (k, v) in &fields.0 {
                    out.push(' ');
                    push_text(&mut out, k);
                    out.push('=');
                    push_text_value(&mut out, v);
                }
                out.push(' ');
                push_text(&mut out, &msg);
            }
            Format::Json => {
                out.push_str("{\"ts\":");
                push_json_str(&mut out, &ts);
                out.push_str(",\"level\":");
                push_json_str(&mut out, level_name(record.level()));
                out.push_str(",\"msg\":");
                push_json_str(&mut out, &msg);
                for (k, v) in &fields.0 {
                    if matches!(k.as_str(), "ts" | "level" | "msg") {
                        continue;
                    }
                    out.push(',');
                    push_json_str(&mut out, k);
                    out.push(':');
                    push_json_str(&mut out, v);
                }
                out.push('}');
            }
        }
        out.push('\n');
        out
    }
}

impl Log for Sink {
    fn enabled(&self, metadata: &Metadata<'_>) -> bool {
        self.wants(metadata)
    }

    fn log(&self, record: &Record<'_>) {
        if !self.wants(record.metadata()) {
            return;
        }
        let line = self.line(record, SystemTime::now());
        // One write per line so lines from a restarting child or another writer never
        // interleave mid-line; a closed stderr must not stop the broker.
        let _ = std::io::stderr().lock().write_all(line.as_bytes());
    }

    fn flush(&self) {
        let _ = std::io::stderr().flush();
    }
}

/// Installs the sink as the process's logger; a second call keeps the first sink.
pub fn init(level: LevelFilter, format: Format) {
    if log::set_logger(Box::leak(Box::new(Sink::new(level, format)))).is_ok() {
        log::set_max_level(level);
    }
}

fn level_name(level: Level) -> &'static str {
    match level {
        Level::Error => "error",
        Level::Warn => "warn",
        Level::Info => "info",
        Level::Debug => "debug",
        Level::Trace => "trace",
    }
}

struct Fields(Vec<(String, String)>);

/// Bounds the fields of one record as the message is bounded.
const MAX_FIELDS: usize = 16;

impl<'kvs> VisitSource<'kvs> for Fields {
    fn visit_pair(&mut self, key: Key<'kvs>, value: Value<'kvs>) -> Result<(), log::kv::Error> {
        if self.0.len() < MAX_FIELDS {
            let mut v = value.to_string();
            truncate(&mut v, MAX_MESSAGE);
            self.0.push((key.as_str().to_string(), v));
        }
        Ok(())
    }
}

fn truncate(s: &mut String, max: usize) {
    if s.len() > max {
        let mut cut = max;
        while !s.is_char_boundary(cut) {
            cut -= 1;
        }
        s.truncate(cut);
        s.push('…');
    }
}

/// Control characters (a newline inside an error text) are escaped so an event stays on one
/// line and cannot forge the next one; so are the invisible ones that reorder or break
/// what a terminal or viewer shows (bidi overrides, zero-width, line separators).
fn push_text(out: &mut String, s: &str) {
    for c in s.chars() {
        push_char(out, c);
    }
}

/// A field's value: quoted (`"` and `\` escaped) when it holds a space, `=`, a quote or a
/// backslash, or is empty, so a value from a client (`x outcome=success`) cannot pass for
/// more fields of the line.
fn push_text_value(out: &mut String, s: &str) {
    let plain = !s.is_empty() && !s.contains([' ', '=', '"', '\\']);
    if plain {
        return push_text(out, s);
    }
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            c => push_char(out, c),
        }
    }
    out.push('"');
}

fn push_char(out: &mut String, c: char) {
    match c {
        '\n' => out.push_str("\\n"),
        '\r' => out.push_str("\\r"),
        '\t' => out.push_str("\\t"),
        c if c.is_control() || invisible(c) => {
            let _ = write!(out, "\\u{{{:x}}}", u32::from(c));
        }
        c => out.push(c),
    }
}

/// Unicode format and separator characters a text log, or a peer's text kept in an error
/// (`jetstream::error::bound_peer_text`), should not carry as they are.
pub(crate) fn invisible(c: char) -> bool {
    matches!(
        u32::from(c),
        0x00ad
            | 0x061c
            | 0x180e
            | 0x200b..=0x200f
            | 0x2028..=0x202e
            | 0x2060..=0x2064
            | 0x2066..=0x206f
            | 0xfeff
            | 0xfff9..=0xfffb
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::{Duration, UNIX_EPOCH};

    fn at() -> SystemTime {
        UNIX_EPOCH + Duration::from_millis(1_796_158_800_123)
    }

    fn line(
        format: Format,
        level: Level,
        kvs: &[(&str, &str)],
        msg: std::fmt::Arguments<'_>,
    ) -> String {
        let sink = Sink::new(LevelFilter::Trace, format);
        sink.line(
            &Record::builder()
                .level(level)
                .target("amp_broker::broker::core")
                .key_values(&kvs)
                .args(msg)
                .build(),
            at(),
        )
    }

    #[test]
    fn text_line_has_time_level_ids_then_message() {
        let l = line(
            Format::Text,
            Level::Info,
            &[("session", "b1-7"), ("participant", "acme/a")],
            format_args!("hello"),
        );
        assert_eq!(
            l,
            "2026-12-01T21:00:00.123Z INFO  session=b1-7 participant=acme/a hello\n"
        );
    }

    #[test]
    fn text_line_escapes_newlines_so_one_event_is_one_line() {
        let l = line(
            Format::Text,
            Level::Warn,
            &[],
            format_args!("a\nforged INFO line\r"),
        );
        assert_eq!(l.matches('\n').count(), 1, "{l}");
        assert!(l.ends_with("WARN  a\\nforged INFO line\\r\n"), "{l}");
    }

    #[test]
    fn a_field_value_cannot_pass_for_more_fields_or_hide_text() {
        // A MIG caller's `message_id` lands in the audit line: unquoted, it added an
        // `outcome` and an `actor` of its choosing for logfmt parsers to read.
        let l = line(
            Format::Text,
            Level::Info,
            &[
                ("outcome", "MIG_TIMEOUT"),
                ("message_id", "x outcome=success actor=acme/ceo"),
                ("quoted", "a\"b\\c"),
                ("empty", ""),
                ("bidi", "abc\u{202e}def\u{2028}"),
                ("why", "a\n2026-12-01T21:00:00.123Z INFO\r\u{1b}[2J"),
            ],
            format_args!("mig invocation \u{200b}"),
        );
        assert!(
            l.contains(r#" message_id="x outcome=success actor=acme/ceo" "#),
            "{l}"
        );
        assert_eq!(l.matches("outcome=").count(), 2, "{l}");
        assert!(l.contains(r#" quoted="a\"b\\c" "#), "{l}");
        assert!(l.contains(r#" empty="" "#), "{l}");
        assert!(l.contains(r" bidi=abc\u{202e}def\u{2028} "), "{l}");
        // A newline in a value is escaped as one in the message is.
        assert_eq!(l.matches('\n').count(), 1, "{l}");
        assert!(
            l.contains(r#" why="a\n2026-12-01T21:00:00.123Z INFO\r\u{1b}[2J" "#),
            "{l}"
        );
        assert!(l.ends_with("mig invocation \\u{200b}\n"), "{l}");
    }

    #[test]
    fn json_line_is_one_object_with_fields() {
        let l = line(
            Format::Json,
            Level::Error,
            &[("task", "t\"1"), ("level", "forged")],
            format_args!("quote \" backslash \\ nl \n ctl \u{1}"),
        );
        assert_eq!(l.matches('\n').count(), 1, "{l}");
        let v: serde_json::Value = serde_json::from_str(l.trim_end()).expect("json");
        assert_eq!(v["ts"], "2026-12-01T21:00:00.123Z");
        assert_eq!(v["level"], "error");
        assert_eq!(v["msg"], "quote \" backslash \\ nl \n ctl \u{1}");
        assert_eq!(v["task"], "t\"1");
        assert_eq!(v.as_object().map(|o| o.len()), Some(4), "{l}");
    }

    #[test]
    fn long_message_is_cut() {
        let long = "é".repeat(MAX_MESSAGE);
        let l = line(Format::Json, Level::Info, &[], format_args!("{long}"));
        let v: serde_json::Value = serde_json::from_str(l.trim_end()).expect("json");
        let msg = v["msg"].as_str().unwrap_or_default();
        assert!(msg.len() <= MAX_MESSAGE + '…'.len_utf8(), "{}", msg.len());
    }

    #[test]
    fn levels_filter_and_dependencies_need_trace() {
        let meta = |level, target| Metadata::builder().level(level).target(target).build();
        let info = Sink::new(LevelFilter::Info, Format::Text);
        assert!(info.wants(&meta(Level::Info, "amp_broker::runtime")));
        assert!(info.wants(&meta(Level::Error, "amp_broker")));
        assert!(!info.wants(&meta(Level::Debug, "amp_broker::runtime")));
        assert!(info.wants(&meta(Level::Warn, "tungstenite::protocol")));
        assert!(!info.wants(&meta(Level::Info, "tungstenite::protocol")));
        let debug = Sink::new(LevelFilter::Debug, Format::Text);
        assert!(debug.wants(&meta(Level::Debug, "amp_broker::broker::jobs")));
        assert!(!debug.wants(&meta(Level::Trace, "amp_broker::broker::jobs")));
        assert!(!debug.wants(&meta(Level::Debug, "tungstenite::protocol")));
        let trace = Sink::new(LevelFilter::Trace, Format::Text);
        assert!(trace.wants(&meta(Level::Trace, "mio::poll")));
        let error = Sink::new(LevelFilter::Error, Format::Text);
        assert!(!error.wants(&meta(Level::Warn, "amp_broker")));
        assert!(!error.wants(&meta(Level::Warn, "tungstenite")));
    }

    #[test]
    fn flag_values_parse() {
        assert_eq!(parse_level("debug"), Ok(LevelFilter::Debug));
        assert!(parse_level("verbose").is_err());
        assert_eq!(Format::parse("json"), Ok(Format::Json));
        assert!(Format::parse("yaml").is_err());
    }
}
