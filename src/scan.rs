//! Byte scans sixteen bytes at a time with SSE2 (on x86_64), else eight in a word, for
//! the checks every frame, subject and envelope goes through: how long a run is before
//! the first byte of a small set.
//!
//! A word is tested with a few integer operations per condition instead of a compare
//! and branch per byte. `v.wrapping_sub(ONES * n) & !v & HIGH` marks the bytes of `v`
//! below `n` (for `n` up to 0x80): a byte at or above `n` is marked only through a
//! borrow out of a lower byte, which was itself below `n`, so the lowest marked byte
//! is the first real one. Equality with `b` is "below 1" of `v ^ (ONES * b)`.

const ONES: u64 = u64::from_ne_bytes([1; 8]);
const HIGH: u64 = ONES * 0x80;

/// How many bytes at the start of `s` are neither below `below` (at most 0x80) nor
/// one of `stops`.
#[inline]
pub fn run_len<const N: usize>(s: &[u8], below: u8, stops: [u8; N]) -> usize {
    #[cfg(all(target_arch = "x86_64", target_feature = "sse2"))]
    {
        let mut done = 0;
        let mut chunks = s.chunks_exact(16);
        for chunk in &mut chunks {
            let hit = sse2_hits(chunk_words(chunk), below, stops);
            if hit != 0 {
                return done + hit.trailing_zeros() as usize;
            }
            done += 16;
        }
        // The tail as one more chunk, its padding masked off: most strings the broker
        // writes are shorter than sixteen bytes.
        let rest = chunks.remainder();
        let hit = sse2_hits(tail_words(rest), below, stops) & !(u32::MAX << rest.len());
        done + if hit != 0 {
            hit.trailing_zeros() as usize
        } else {
            rest.len()
        }
    }
    #[cfg(not(all(target_arch = "x86_64", target_feature = "sse2")))]
    portable::run_len(s, below, stops)
}

/// A 16-byte chunk as its two little-endian words.
#[inline(always)]
fn chunk_words(chunk: &[u8]) -> (u64, u64) {
    let word =
        |h: Option<&[u8]>| u64::from_le_bytes(h.and_then(|h| h.try_into().ok()).unwrap_or([0; 8]));
    (word(chunk.get(..8)), word(chunk.get(8..16)))
}

/// The bytes of `rest` (fewer than sixteen) as the two little-endian words of a 16-byte
/// chunk, zero past its end, read with a few fixed-size loads (overlapping where the
/// length is not a whole word): copying a tail into a padded buffer called `memcpy`.
#[inline(always)]
fn tail_words(rest: &[u8]) -> (u64, u64) {
    let n = rest.len();
    let w8 = |at: usize| {
        rest.get(at..at + 8)
            .and_then(|b| b.try_into().ok())
            .map_or(0, u64::from_le_bytes)
    };
    let w4 = |at: usize| {
        rest.get(at..at + 4)
            .and_then(|b| b.try_into().ok())
            .map_or(0, |b| u64::from(u32::from_le_bytes(b)))
    };
    match n {
        // The last word ends at the tail's end: its first `16 - n` bytes are the first
        // word's again.
        8.. => (
            w8(0),
            w8(n - 8).checked_shr(8 * (16 - n) as u32).unwrap_or(0),
        ),
        4.. => (w4(0) | (w4(n - 4) << (8 * (n - 4))), 0),
        _ => (
            rest.iter().rev().fold(0, |w, &b| (w << 8) | u64::from(b)),
            0,
        ),
    }
}

/// One bit per byte of a 16-byte chunk (its two words; lowest byte first) that is below
/// `below` or one of `stops`.
#[cfg(all(target_arch = "x86_64", target_feature = "sse2"))]
#[inline(always)]
fn sse2_hits<const N: usize>((lo, hi): (u64, u64), below: u8, stops: [u8; N]) -> u32 {
    use std::arch::x86_64::*;
    // SAFETY: these intrinsics only need SSE2, which this build enables (cfg above);
    // none of them touches memory.
    unsafe {
        let v = _mm_set_epi64x(hi as i64, lo as i64);
        let mut hit = match below.checked_sub(1) {
            // Unsigned v < below: min(v, below - 1) == v.
            Some(top) => _mm_cmpeq_epi8(_mm_min_epu8(v, _mm_set1_epi8(top as i8)), v),
            None => _mm_setzero_si128(),
        };
        for stop in stops {
            hit = _mm_or_si128(hit, _mm_cmpeq_epi8(v, _mm_set1_epi8(stop as i8)));
        }
        _mm_movemask_epi8(hit) as u32
    }
}

/// How many bytes at the start of `s` a JSON string holds as they are: none of `"`,
/// `\\`, a control character or DEL (valid unescaped, but escaped in what the broker
/// writes, so that text is safe on a terminal).
#[inline]
pub fn json_plain_len(s: &[u8]) -> usize {
    run_len(s, 0x20, [b'"', b'\\', 0x7f])
}

/// The checks of a subject every delivered message goes through, in one pass: `None`
/// when `s` holds a byte at or below space, DEL, `*` or `>` (the caller looks closer);
/// else whether it holds two `.` in a row, and whether it is all ASCII.
#[inline]
pub fn plain_subject(s: &[u8]) -> Option<(bool, bool)> {
    #[cfg(all(target_arch = "x86_64", target_feature = "sse2"))]
    {
        let (mut double, mut high, mut last_dot) = (false, 0u32, false);
        let mut chunk = |(bad, dots, non_ascii): (u32, u32, u32)| {
            double |= dots & (dots >> 1) != 0 || (last_dot && dots & 1 != 0);
            last_dot = dots & 0x8000 != 0;
            high |= non_ascii;
            bad == 0
        };
        let mut chunks = s.chunks_exact(16);
        for words in (&mut chunks).map(chunk_words) {
            if !chunk(sse2_subject_masks(words)) {
                return None;
            }
        }
        // The tail as one more chunk; its zero padding is not a bad byte.
        let rest = chunks.remainder();
        if !rest.is_empty() {
            let (bad, dots, non_ascii) = sse2_subject_masks(tail_words(rest));
            if !chunk((bad & !(u32::MAX << rest.len()), dots, non_ascii)) {
                return None;
            }
        }
        Some((double, high == 0))
    }
    #[cfg(not(all(target_arch = "x86_64", target_feature = "sse2")))]
    portable::plain_subject(s)
}

/// A literal subject's byte checks in one pass: `None` when `s` holds one of `stops` (the
/// caller looks closer), else whether it holds two `.` in a row. Every subject the
/// broker publishes to is checked (its inbox's, every ack's), and a second pass for the
/// dots cost as much as the first.
#[inline]
pub fn double_dot_unless<const N: usize>(s: &[u8], stops: [u8; N]) -> Option<bool> {
    #[cfg(all(target_arch = "x86_64", target_feature = "sse2"))]
    {
        let (mut double, mut last_dot) = (false, false);
        let mut chunk = |words: (u64, u64), valid: u32| {
            let dots = dot_mask(words);
            double |= dots & (dots >> 1) != 0 || (last_dot && dots & 1 != 0);
            last_dot = dots & 0x8000 != 0;
            sse2_hits(words, 0, stops) & valid == 0
        };
        let mut chunks = s.chunks_exact(16);
        for words in (&mut chunks).map(chunk_words) {
            if !chunk(words, u32::MAX) {
                return None;
            }
        }
        // The tail as one more chunk; its zero padding is neither a stop nor a dot.
        let rest = chunks.remainder();
        if !rest.is_empty() && !chunk(tail_words(rest), !(u32::MAX << rest.len())) {
            return None;
        }
        Some(double)
    }
    #[cfg(not(all(target_arch = "x86_64", target_feature = "sse2")))]
    portable::double_dot_unless(s, stops)
}

/// Of a 16-byte chunk (its two words), one bit per byte: at or below space, DEL, `*` or
/// `>`; `.`; not ASCII.
#[cfg(all(target_arch = "x86_64", target_feature = "sse2"))]
#[inline(always)]
fn sse2_subject_masks((lo, hi): (u64, u64)) -> (u32, u32, u32) {
    use std::arch::x86_64::*;
    // SAFETY: these intrinsics only need SSE2, which this build enables (cfg above);
    // none of them touches memory.
    unsafe {
        let v = _mm_set_epi64x(hi as i64, lo as i64);
        let is = |b: u8| _mm_cmpeq_epi8(v, _mm_set1_epi8(b as i8));
        let low = _mm_cmpeq_epi8(_mm_min_epu8(v, _mm_set1_epi8(0x20)), v);
        let bad = _mm_or_si128(
            _mm_or_si128(low, is(0x7f)),
            _mm_or_si128(is(b'*'), is(b'>')),
        );
        (
            _mm_movemask_epi8(bad) as u32,
            _mm_movemask_epi8(is(b'.')) as u32,
            _mm_movemask_epi8(v) as u32,
        )
    }
}

/// Where the first `N` `.`s of `s` are, and how many it holds in all, found sixteen
/// bytes a step: every delivery's `$JS.ACK` subject is split at its dots, and a `memchr`
/// per token cost more than the rest of its reading.
#[inline]
pub fn dots<const N: usize>(s: &[u8]) -> ([usize; N], usize) {
    let (mut at, mut count) = ([0; N], 0);
    let mut take = |base: usize, mut mask: u32| {
        while mask != 0 {
            if let Some(p) = at.get_mut(count) {
                *p = base + mask.trailing_zeros() as usize;
            }
            count += 1;
            mask &= mask - 1;
        }
    };
    let mut chunks = s.chunks_exact(16);
    for (i, chunk) in (&mut chunks).enumerate() {
        take(i * 16, dot_mask(chunk_words(chunk)));
    }
    // The tail as one more chunk, padded with zeros, which are not dots.
    let rest = chunks.remainder();
    if !rest.is_empty() {
        take(s.len() - rest.len(), dot_mask(tail_words(rest)));
    }
    (at, count)
}

/// The value of up to nineteen ASCII digits (`None` for any other byte or none at
/// all), eight at a time: a delivery's ack subject carries five numbers, one of them a
/// nineteen-digit timestamp.
#[inline]
pub fn digits(s: &[u8]) -> Option<u64> {
    if s.is_empty() || s.len() > 19 {
        return None;
    }
    let mut chunks = s.chunks_exact(8);
    let mut n = 0u64;
    for chunk in &mut chunks {
        let mut bytes = [0u8; 8];
        bytes.copy_from_slice(chunk);
        let v = u64::from_le_bytes(bytes);
        // Every byte 0x30..=0x3f, and its low nibble below ten.
        let d = v.wrapping_sub(ONES * u64::from(b'0'));
        if v & (ONES * 0xf0) != ONES * 0x30 || d.wrapping_add(ONES * 0x76) & HIGH != 0 {
            return None;
        }
        // Pairs, fours, then all eight: the first digit is the lowest byte.
        let d = (d.wrapping_mul(10) + (d >> 8)) & 0x00ff_00ff_00ff_00ff;
        let d = (d.wrapping_mul(100) + (d >> 16)) & 0x0000_ffff_0000_ffff;
        let d = (d.wrapping_mul(10_000) + (d >> 32)) & 0xffff_ffff;
        // At most nineteen digits in all: no overflow.
        n = n * 100_000_000 + d;
    }
    chunks.remainder().iter().try_fold(n, |n, &b| {
        let digit = b.wrapping_sub(b'0');
        (digit <= 9).then(|| n * 10 + u64::from(digit))
    })
}

/// One bit per `.` of a 16-byte chunk (its two words), lowest first.
#[inline(always)]
fn dot_mask((lo, hi): (u64, u64)) -> u32 {
    #[cfg(all(target_arch = "x86_64", target_feature = "sse2"))]
    {
        use std::arch::x86_64::*;
        // SAFETY: these intrinsics only need SSE2, which this build enables (cfg above);
        // none of them touches memory.
        unsafe {
            let v = _mm_set_epi64x(hi as i64, lo as i64);
            _mm_movemask_epi8(_mm_cmpeq_epi8(v, _mm_set1_epi8(b'.' as i8))) as u32
        }
    }
    #[cfg(not(all(target_arch = "x86_64", target_feature = "sse2")))]
    portable::dot_mask((lo, hi))
}

/// The scans without SSE2, a word at a time (aarch64 edge nodes, among others). Always
/// compiled, so the tests on x86_64 hold them to the byte loops too: a build for another
/// target runs no code the test suite has not run.
#[cfg_attr(all(target_arch = "x86_64", target_feature = "sse2"), allow(dead_code))]
mod portable {
    use super::{HIGH, ONES, has_double_dot};

    pub fn run_len<const N: usize>(s: &[u8], below: u8, stops: [u8; N]) -> usize {
        let below_in = |v: u64, n: u8| v.wrapping_sub(ONES * u64::from(n)) & !v & HIGH;
        let mut done = 0;
        for chunk in s.chunks_exact(8) {
            let mut bytes = [0u8; 8];
            bytes.copy_from_slice(chunk);
            let w = u64::from_le_bytes(bytes);
            let mut hit = below_in(w, below);
            for stop in stops {
                hit |= below_in(w ^ (ONES * u64::from(stop)), 1);
            }
            if hit != 0 {
                return done + (hit.trailing_zeros() / 8) as usize;
            }
            done += 8;
        }
        let tail = s.get(done..).unwrap_or_default();
        // Every stop compared without a branch (`contains` calls a byte search per byte).
        done + tail
            .iter()
            .position(|&b| b < below || stops.iter().fold(false, |hit, &s| hit | (s == b)))
            .unwrap_or(tail.len())
    }

    pub fn plain_subject(s: &[u8]) -> Option<(bool, bool)> {
        (run_len(s, 0x21, [0x7f, b'*', b'>']) == s.len()).then(|| (has_double_dot(s), s.is_ascii()))
    }

    pub fn double_dot_unless<const N: usize>(s: &[u8], stops: [u8; N]) -> Option<bool> {
        (run_len(s, 0, stops) == s.len()).then(|| has_double_dot(s))
    }

    pub fn dot_mask((lo, hi): (u64, u64)) -> u32 {
        (lo.to_le_bytes().into_iter().chain(hi.to_le_bytes()))
            .enumerate()
            .fold(0, |m, (i, b)| m | (u32::from(b == b'.') << i))
    }
}

/// True when `s` holds two `.` in a row, a word at a time: the empty-token test every
/// subject goes through (a `memchr` per `.` cost more than the whole scan).
#[inline]
pub fn has_double_dot(s: &[u8]) -> bool {
    const LOW7: u64 = ONES * 0x7f;
    const DOTS: u64 = ONES * b'.' as u64;
    // The high bit of every `.` byte, exactly: no borrow runs between bytes here.
    let dots = |v: u64| {
        let x = v ^ DOTS;
        !(((x & LOW7) + LOW7) | x) & HIGH
    };
    let mut last_was_dot = false;
    let mut chunks = s.chunks_exact(8);
    for chunk in &mut chunks {
        let mut bytes = [0u8; 8];
        bytes.copy_from_slice(chunk);
        let d = dots(u64::from_le_bytes(bytes));
        // A dot whose next byte is one too, within the word or across its start.
        if d & (d >> 8) != 0 || (last_was_dot && d & 0x80 != 0) {
            return true;
        }
        last_was_dot = d >> 63 != 0;
    }
    for &b in chunks.remainder() {
        let dot = b == b'.';
        if dot && last_was_dot {
            return true;
        }
        last_was_dot = dot;
    }
    false
}

#[cfg(test)]
mod tests {
    use super::*;

    fn slow<const N: usize>(s: &[u8], below: u8, stops: [u8; N]) -> usize {
        s.iter()
            .position(|&b| b < below || stops.contains(&b))
            .unwrap_or(s.len())
    }

    /// Every string over `alphabet` of `0..=max` bytes, each also behind prefixes that put
    /// it across the first chunk's end and into the tail (0 to 17 filler bytes).
    fn every_string(alphabet: &[u8], max: usize, mut check: impl FnMut(&[u8])) {
        let mut cases: Vec<Vec<u8>> = vec![Vec::new()];
        for len in 0..=max {
            for case in &cases {
                for pad in [0, 1, 7, 8, 11, 12, 13, 14, 15, 16, 17] {
                    let mut s = vec![b'a'; pad];
                    s.extend_from_slice(case);
                    check(&s);
                }
            }
            if len < max {
                cases = cases
                    .iter()
                    .flat_map(|c| alphabet.iter().map(move |&b| [c.as_slice(), &[b]].concat()))
                    .collect();
            }
        }
    }

    /// The scans' answers computed a byte at a time.
    fn slow_double_dot(s: &[u8]) -> bool {
        s.windows(2).any(|w| w == b"..")
    }

    #[test]
    fn every_scan_answers_as_a_byte_loop_over_every_short_string_of_nasty_bytes() {
        let alphabet = b"\"\\.*>09a{}\x00\x7f\xff \x1f\x80\t";
        let mut checked = 0usize;
        every_string(alphabet, 4, |s| {
            checked += 1;
            for (below, stops) in [
                (0x20, [b'"', b'\\', 0x7f]),
                (0x21, [0x7f, b'*', b'>']),
                (0, [b' ', b'*', b'>']),
            ] {
                assert_eq!(run_len(s, below, stops), slow(s, below, stops), "{s:?}");
                let portable = portable::run_len(s, below, stops);
                assert_eq!(portable, slow(s, below, stops), "{s:?}");
            }
            assert_eq!(
                json_plain_len(s),
                slow(s, 0x20, [b'"', b'\\', 0x7f]),
                "{s:?}"
            );
            let subject = (slow(s, 0x21, [0x7f, b'*', b'>']) == s.len())
                .then(|| (slow_double_dot(s), s.is_ascii()));
            assert_eq!(plain_subject(s), subject, "{s:?}");
            assert_eq!(portable::plain_subject(s), subject, "{s:?}");
            let stops = [b' ', b'\t', b'\r', b'\n', 0x0c, b'*', b'>'];
            let literal = (slow(s, 0, stops) == s.len()).then(|| slow_double_dot(s));
            assert_eq!(double_dot_unless(s, stops), literal, "{s:?}");
            assert_eq!(portable::double_dot_unless(s, stops), literal, "{s:?}");
            // A stop of zero: the tail's padding must not be taken for it.
            let zero = (slow(s, 0, [0]) == s.len()).then(|| slow_double_dot(s));
            assert_eq!(double_dot_unless(s, [0]), zero, "{s:?}");
            assert_eq!(portable::double_dot_unless(s, [0]), zero, "{s:?}");
            assert_eq!(has_double_dot(s), slow_double_dot(s), "{s:?}");
            let want: Vec<usize> = (0..s.len()).filter(|&i| s[i] == b'.').collect();
            let mut chunk = [0u8; 16];
            let head = &s[..s.len().min(16)];
            chunk[..head.len()].copy_from_slice(head);
            let mask = head
                .iter()
                .enumerate()
                .fold(0, |m, (i, &b)| m | (u32::from(b == b'.') << i));
            assert_eq!(portable::dot_mask(chunk_words(&chunk)), mask, "{s:?}");
            let (at, count) = dots::<3>(s);
            assert_eq!(count, want.len(), "{s:?}");
            assert_eq!(&at[..count.min(3)], &want[..count.min(3)], "{s:?}");
        });
        assert!(checked > 100_000, "{checked}");
    }

    #[test]
    fn digits_read_every_short_string_of_digits_and_near_digits_as_parse_does() {
        let reference = |s: &[u8]| {
            std::str::from_utf8(s)
                .ok()
                .filter(|t| !t.is_empty() && t.len() <= 19 && t.bytes().all(|b| b.is_ascii_digit()))
                .and_then(|t| t.parse::<u64>().ok())
        };
        // Every string of up to four bytes over digits and the bytes around them, alone
        // and behind runs of digits that place it across each 8-digit group.
        let alphabet = b"0189/:\x00\xb0\xb9\x40a.-+ ";
        let mut cases: Vec<Vec<u8>> = vec![Vec::new()];
        for _ in 0..4 {
            cases = cases
                .iter()
                .flat_map(|c| alphabet.iter().map(move |&b| [c.as_slice(), &[b]].concat()))
                .chain(cases.iter().cloned())
                .collect();
            cases.sort();
            cases.dedup();
        }
        for case in &cases {
            for lead in 0..=16 {
                let mut s: Vec<u8> = (0..lead).map(|i| b"9876543210"[i % 10]).collect();
                s.extend_from_slice(case);
                assert_eq!(digits(&s), reference(&s), "{s:?}");
            }
        }
        for n in [
            0,
            1,
            10_000_000,
            99_999_999,
            100_000_000,
            u64::MAX / 10,
            9_999_999_999_999_999_999,
        ] {
            for width in 1..=21 {
                let s = format!("{n:0width$}");
                assert_eq!(digits(s.as_bytes()), reference(s.as_bytes()), "{s}");
            }
        }
    }

    #[test]
    fn a_tail_reads_as_its_bytes_padded_with_zeros() {
        let bytes: Vec<u8> = (0..16u8).map(|i| 0xf1 - i * 15).collect();
        for n in 0..16 {
            let mut padded = [0u8; 16];
            padded[..n].copy_from_slice(&bytes[..n]);
            let want = (
                u64::from_le_bytes(padded[..8].try_into().unwrap()),
                u64::from_le_bytes(padded[8..].try_into().unwrap()),
            );
            assert_eq!(tail_words(&bytes[..n]), want, "{n}");
        }
    }

    #[test]
    fn dots_are_found_wherever_they_are() {
        // Every placement of up to three dots in texts across the 16-byte chunks and the
        // tail, with non-ASCII bytes around them.
        for len in 0..40 {
            for a in 0..len {
                for b in a..len {
                    for c in [b, len - 1, a + 1] {
                        let mut s: Vec<u8> =
                            (0..len).map(|i| [b'x', 0xc3, 0xa9, 0][i % 4]).collect();
                        for at in [a, b, c] {
                            if let Some(byte) = s.get_mut(at) {
                                *byte = b'.';
                            }
                        }
                        let want: Vec<usize> = (0..len).filter(|&i| s[i] == b'.').collect();
                        let (at, count) = dots::<2>(&s);
                        assert_eq!(count, want.len(), "{s:?}");
                        let kept = count.min(2);
                        assert_eq!(&at[..kept], &want[..kept], "{s:?}");
                    }
                }
            }
        }
        let (at, count) = dots::<12>(b"$JS.ACK.S.C.1.2.3.4.5");
        assert_eq!(count, 8);
        assert_eq!(at[..8], [3, 7, 9, 11, 13, 15, 17, 19]);
        assert_eq!(dots::<1>(b""), ([0], 0));
    }

    #[test]
    fn digits_read_as_u64_parse_reads_them() {
        let mut cases: Vec<Vec<u8>> = vec![vec![], b"0".to_vec(), b"007".to_vec()];
        for len in 1..=21 {
            cases.push(vec![b'9'; len]);
            cases.push((0..len).map(|i| b'0' + (i * 7 % 10) as u8).collect());
            // Each position holding each byte that is almost a digit.
            for at in 0..len {
                for bad in [
                    b'/',
                    b':',
                    b'0' + 0x80,
                    b'0' - 0x10,
                    b'9' + 0x10,
                    0,
                    0xff,
                    b' ',
                ] {
                    let mut s = vec![b'5'; len];
                    s[at] = bad;
                    cases.push(s);
                }
            }
        }
        for s in cases {
            let want = std::str::from_utf8(&s)
                .ok()
                .filter(|t| !t.is_empty() && t.len() <= 19 && t.bytes().all(|b| b.is_ascii_digit()))
                .and_then(|t| t.parse::<u64>().ok());
            assert_eq!(digits(&s), want, "{s:?}");
        }
        assert_eq!(
            digits(b"1733600000123456789"),
            Some(1_733_600_000_123_456_789)
        );
        assert_eq!(
            digits(b"9999999999999999999"),
            Some(9_999_999_999_999_999_999)
        );
    }

    #[test]
    fn a_subject_pass_finds_stops_and_double_dots_as_the_two_scans_do() {
        const STOPS: [u8; 3] = [b' ', b'*', 0];
        for len in 0..40 {
            for at in 0..len {
                for (first, second) in [
                    (b'.', b'.'),
                    (b'.', b'a'),
                    (b'*', b'.'),
                    (b'.', 0),
                    (0xff, b'.'),
                ] {
                    let mut s: Vec<u8> =
                        (0..len).map(|i| [b'a', b'.', 0xc3, b'-'][i % 4]).collect();
                    s[at] = first;
                    if let Some(next) = s.get_mut(at + 1) {
                        *next = second;
                    }
                    let want = (run_len(&s, 0, STOPS) == s.len()).then(|| has_double_dot(&s));
                    assert_eq!(double_dot_unless(&s, STOPS), want, "{s:?}");
                }
            }
        }
    }

    #[test]
    fn a_double_dot_is_found_wherever_it_is() {
        for len in 0..20 {
            for at in 0..len {
                for filler in [b'a', b'/', b'-', 0x2d, 0xae, 0xff, 0] {
                    let mut s = vec![filler; len];
                    s[at] = b'.';
                    assert!(!has_double_dot(&s), "{len} {at} {filler:#x}");
                    if at + 1 < len {
                        s[at + 1] = b'.';
                        assert!(has_double_dot(&s), "{len} {at} {filler:#x}");
                    }
                }
            }
        }
        assert!(!has_double_dot(b"$JS.ACK.S.C.1.2.3.4.5"));
        assert!(has_double_dot(b"$JS.ACK.S.C.1..3.4.5"));
    }

    #[test]
    fn the_run_ends_at_the_first_stop_wherever_it_is_and_whatever_precedes_it() {
        // Every byte value at every position of runs of two 16-byte chunks and a tail,
        // and of tails alone of every length, among fillers that could borrow into it
        // or be taken for it.
        for len in [43, 1, 2, 3, 4, 5, 7, 8, 9, 12, 15, 16, 17] {
            run_ends_at_the_first_stop(len);
        }
        assert_eq!(run_len(b"", 0x20, [b'"']), 0);
        assert_eq!(run_len(b"\x80\xff\x7f\x80", 0x80, []), 2);
        let text = "日本語のテキスト".as_bytes();
        assert_eq!(run_len(text, 0x20, [b'"', b'\\', 0x7f]), text.len());
    }

    fn run_ends_at_the_first_stop(len: usize) {
        for special in 0..=255u8 {
            for at in 0..len {
                for filler in [b'a', 0x21, 0x7e, 0x80, 0xff, b' ', 0] {
                    let mut s = vec![filler; len];
                    s[at] = special;
                    for (below, stops) in [
                        (0x20, [b'"', b'\\', 0x7f]),
                        (0x21, [0x7f, b'*', b'>']),
                        (0, [b' ', b'\t', b'>']),
                        (0x80, [0, 0, 0]),
                    ] {
                        assert_eq!(
                            run_len(&s, below, stops),
                            slow(&s, below, stops),
                            "{special:#x} at {at} among {filler:#x}"
                        );
                    }
                    if at + 1 < len {
                        s[at + 1] = 0;
                        assert_eq!(run_len(&s, 0x20, [b'"']), slow(&s, 0x20, [b'"']));
                    }
                }
            }
        }
    }
}
