//! RFC 3339 timestamps in UTC with milliseconds (`2026-11-29T08:11:00.123Z`), the form of
//! every `ts`, `since`, `at` and `lease_until` the broker writes, and parsing of the
//! timestamps clients send (`from: {"time": ...}`), with any offset and precision.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// Formats milliseconds since the Unix epoch.
pub fn format_millis(ms: i64) -> String {
    let mut out = String::with_capacity(24);
    push_millis(&mut out, ms);
    out
}

/// [`format_millis`] appended to `out`.
pub fn push_millis(out: &mut String, ms: i64) {
    let days = ms.div_euclid(86_400_000);
    let rem = ms.rem_euclid(86_400_000);
    let (y, m, d) = civil_from_days(days);
    let (h, min, s, milli) = (
        rem / 3_600_000,
        rem / 60_000 % 60,
        rem / 1000 % 60,
        rem % 1000,
    );
    if !(0..=9999).contains(&y) {
        use std::fmt::Write;
        let _ = write!(
            out,
            "{y:04}-{m:02}-{d:02}T{h:02}:{min:02}:{s:02}.{milli:03}Z"
        );
        return;
    }
    // Every `send` stamps one: digits written into place, without the formatting
    // machinery.
    let mut text = *b"0000-00-00T00:00:00.000Z";
    let mut put = |at: usize, width: usize, mut n: i64| {
        for slot in text.iter_mut().skip(at).take(width).rev() {
            *slot = b'0' + (n % 10) as u8;
            n /= 10;
        }
    };
    put(0, 4, y);
    put(5, 2, m);
    put(8, 2, d);
    put(11, 2, h);
    put(14, 2, min);
    put(17, 2, s);
    put(20, 3, milli);
    // ASCII digits and separators: always UTF-8.
    out.push_str(std::str::from_utf8(&text).unwrap_or_default());
}

/// [`push_millis`] for stamps that come in order, as every `send`'s `ts` does: the text
/// up to the milliseconds is kept from the last second written, so a stamp is a copy and
/// three digits rather than a calendar computation.
#[derive(Debug, Default)]
pub struct MillisWriter {
    /// The second `prefix` spells, up to and with its `.`.
    second: Option<i64>,
    prefix: String,
}

impl MillisWriter {
    /// Appends what [`push_millis`] would.
    pub fn push(&mut self, out: &mut String, ms: i64) {
        let milli = ms.rem_euclid(1000);
        let Some(start) = ms.checked_sub(milli) else {
            return push_millis(out, ms);
        };
        if self.second != Some(start) {
            self.prefix.clear();
            push_millis(&mut self.prefix, start);
            // Every form ends `.000Z`.
            self.prefix.truncate(self.prefix.len().saturating_sub(4));
            self.second = Some(start);
        }
        out.push_str(&self.prefix);
        for digit in [milli / 100, milli / 10 % 10, milli % 10] {
            out.push(char::from(b'0' + digit as u8));
        }
        out.push('Z');
    }
}

pub fn format_system_time(t: SystemTime) -> String {
    format_millis(unix_millis(t))
}

pub fn unix_millis(t: SystemTime) -> i64 {
    match t.duration_since(UNIX_EPOCH) {
        Ok(d) => i64::try_from(d.as_millis()).unwrap_or(i64::MAX),
        Err(e) => -i64::try_from(e.duration().as_millis()).unwrap_or(i64::MAX),
    }
}

/// Parses `YYYY-MM-DDTHH:MM:SS[.fraction](Z|±HH:MM)` (a lowercase `t`/`z` or a space as
/// the separator too) into nanoseconds since the Unix epoch.
pub fn parse_nanos(s: &str) -> Option<i128> {
    let b = s.as_bytes();
    if b.len() < 20 {
        return None;
    }
    let num = |r: std::ops::Range<usize>| -> Option<i64> {
        let part = b.get(r)?;
        if part.iter().all(u8::is_ascii_digit) {
            std::str::from_utf8(part).ok()?.parse().ok()
        } else {
            None
        }
    };
    let (year, month, day) = (num(0..4)?, num(5..7)?, num(8..10)?);
    let (hour, minute, second) = (num(11..13)?, num(14..16)?, num(17..19)?);
    if b[4] != b'-'
        || b[7] != b'-'
        || !matches!(b[10], b'T' | b't' | b' ')
        || b[13] != b':'
        || b[16] != b':'
    {
        return None;
    }
    if !(1..=12).contains(&month) || day < 1 || day > days_in_month(year, month) {
        return None;
    }
    if hour > 23 || minute > 59 || second > 60 {
        return None;
    }
    let mut i = 19;
    let mut nanos: i128 = 0;
    if b.get(i) == Some(&b'.') {
        i += 1;
        let start = i;
        while b.get(i).is_some_and(u8::is_ascii_digit) {
            if i - start < 9 {
                nanos = nanos * 10 + i128::from(b[i] - b'0');
            }
            i += 1;
        }
        let digits = i - start;
        if digits == 0 {
            return None;
        }
        for _ in digits..9 {
            nanos *= 10;
        }
    }
    let offset_s: i64 = match b.get(i)? {
        b'Z' | b'z' if i + 1 == b.len() => 0,
        sign @ (b'+' | b'-') if i + 6 == b.len() && b[i + 3] == b':' => {
            let (oh, om) = (num(i + 1..i + 3)?, num(i + 4..i + 6)?);
            if oh > 23 || om > 59 {
                return None;
            }
            let off = oh * 3600 + om * 60;
            if *sign == b'+' { off } else { -off }
        }
        _ => return None,
    };
    let secs =
        days_from_civil(year, month, day) * 86_400 + hour * 3600 + minute * 60 + second - offset_s;
    Some(i128::from(secs) * 1_000_000_000 + nanos)
}

pub fn parse_system_time(s: &str) -> Option<SystemTime> {
    let nanos = parse_nanos(s)?;
    let magnitude = Duration::from_nanos(u64::try_from(nanos.unsigned_abs()).ok()?);
    if nanos >= 0 {
        UNIX_EPOCH.checked_add(magnitude)
    } else {
        UNIX_EPOCH.checked_sub(magnitude)
    }
}

fn is_leap(y: i64) -> bool {
    (y % 4 == 0 && y % 100 != 0) || y % 400 == 0
}

fn days_in_month(y: i64, m: i64) -> i64 {
    match m {
        2 if is_leap(y) => 29,
        2 => 28,
        4 | 6 | 9 | 11 => 30,
        _ => 31,
    }
}

// Howard Hinnant's days-from-civil algorithms (proleptic Gregorian calendar).
fn days_from_civil(y: i64, m: i64, d: i64) -> i64 {
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let mp = (m + 9) % 12;
    let doy = (153 * mp + 2) / 5 + d - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

fn civil_from_days(z: i64) -> (i64, i64, i64) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    (yoe + era * 400 + i64::from(m <= 2), m, d)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_writer_writes_what_push_millis_writes() {
        let mut writer = MillisWriter::default();
        let mut times: Vec<i64> = vec![
            0,
            999,
            1000,
            -1,
            -999,
            -1000,
            -1001,
            1_795_939_860_123,
            951_782_400_000,
            253_402_300_799_999,
            253_402_300_800_000,
            -62_167_219_200_000,
            -62_167_219_200_001,
            i64::MAX,
            i64::MIN,
            i64::MIN + 1000,
        ];
        // Runs in order across seconds, minutes and a day, and back again.
        times.extend((0..3000).map(|i| 1_795_939_199_000 + i * 7));
        times.extend((0..100).map(|i| 1_795_939_199_500 - i * 13));
        // A clock wandering both ways across a new year (2027-01-01T00:00:00Z), the
        // epoch and year 10000, stepping back into the second it just left.
        let mut state = 0x2545_f491_4f6c_dd1du64;
        for start in [1_798_761_599_000i64, -1500, 253_402_300_799_000] {
            let mut ms = start;
            for _ in 0..20_000 {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                ms += (state % 3001) as i64 - 1500;
                times.push(ms);
            }
        }
        for ms in times {
            let (mut want, mut got) = (String::from("x"), String::from("x"));
            push_millis(&mut want, ms);
            writer.push(&mut got, ms);
            assert_eq!(got, want, "{ms}");
        }
    }

    #[test]
    fn formats_utc_with_milliseconds() {
        assert_eq!(format_millis(0), "1970-01-01T00:00:00.000Z");
        assert_eq!(format_millis(1_795_939_860_123), "2026-11-29T08:11:00.123Z");
        assert_eq!(format_millis(951_782_400_000), "2000-02-29T00:00:00.000Z");
        assert_eq!(format_millis(-1), "1969-12-31T23:59:59.999Z");
    }

    #[test]
    fn direct_digits_are_what_format_writes() {
        let reference = |ms: i64| {
            let (days, rem) = (ms.div_euclid(86_400_000), ms.rem_euclid(86_400_000));
            let (y, m, d) = civil_from_days(days);
            let (h, min, s, milli) = (
                rem / 3_600_000,
                rem / 60_000 % 60,
                rem / 1000 % 60,
                rem % 1000,
            );
            format!("{y:04}-{m:02}-{d:02}T{h:02}:{min:02}:{s:02}.{milli:03}Z")
        };
        let mut ms: i64 = -62_200_000_000_000;
        while ms < 260_000_000_000_000 {
            assert_eq!(format_millis(ms), reference(ms), "{ms}");
            ms += 7_777_777_777;
        }
        for ms in [
            0,
            -1,
            253_402_300_799_999,
            253_402_300_800_000,
            -62_167_219_200_001,
        ] {
            assert_eq!(format_millis(ms), reference(ms), "{ms}");
        }
    }

    #[test]
    fn parses_offsets_and_fractions() {
        assert_eq!(parse_nanos("1970-01-01T00:00:00Z"), Some(0));
        assert_eq!(
            parse_nanos("2026-11-29T08:11:00.123Z"),
            Some(1_795_939_860_123_000_000)
        );
        assert_eq!(
            parse_nanos("2026-11-29T09:11:00.123+01:00"),
            Some(1_795_939_860_123_000_000)
        );
        assert_eq!(parse_nanos("1970-01-01T00:00:00.000000001Z"), Some(1));
        assert_eq!(
            parse_nanos("1970-01-01t00:00:00.5-00:30"),
            Some(1_800_500_000_000)
        );
    }

    #[test]
    fn round_trips_every_day_across_four_centuries() {
        for day in (-146_097..146_097).step_by(7) {
            let ms = day * 86_400_000 + 45_296_789;
            let text = format_millis(ms);
            assert_eq!(
                parse_nanos(&text),
                Some(i128::from(ms) * 1_000_000),
                "{text}"
            );
        }
    }

    #[test]
    fn rejects_malformed_timestamps() {
        for bad in [
            "",
            "2026-11-28",
            "2026-11-28T08:11:00",
            "2026-13-01T00:00:00Z",
            "2026-02-29T00:00:00Z",
            "2026-11-28T24:00:00Z",
            "2026-11-28T08:11:00.Z",
            "2026-11-28T08:11:00+0100",
            "2026-11-28T08:11:00Zjunk",
            "2026-1a-28T08:11:00Z",
            "２026-11-28T08:11:00Z",
        ] {
            assert_eq!(parse_nanos(bad), None, "{bad}");
        }
    }
}
