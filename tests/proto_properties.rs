//! Round-trip and split-invariance properties of the protocol core over many
//! deterministic pseudo-random inputs (the same checks the fuzz targets run).

#[path = "../fuzz/checks.rs"]
mod checks;

use checks::Rng;

fn random_bytes(rng: &mut Rng, max: usize) -> Vec<u8> {
    let n = rng.below(max as u64 + 1) as usize;
    (0..n).map(|_| rng.next() as u8).collect()
}

#[test]
fn encoded_operations_parse_back_whole_and_split() {
    let mut rng = Rng::new(0x5eed);
    for _ in 0..3000 {
        checks::check_roundtrip(&random_bytes(&mut rng, 400));
    }
}

/// Valid streams with random bytes flipped: whatever the parser makes of them, split
/// parses agree with whole parses and nothing panics.
#[test]
fn mutated_streams_parse_the_same_however_split() {
    const STREAMS: [&[u8]; 4] = [
        b"\x00\x07INFO {\"a\":1}\r\nMSG foo 1 5\r\nhello\r\nHMSG foo 1 r 12 14\r\nNATS/1.0\r\n\r\nhi\r\nPING\r\n+OK\r\n-ERR 'x'\r\n",
        b"\x01\x09CONNECT {}\r\nPUB foo 5\r\nhello\r\nHPUB foo r 12 14\r\nNATS/1.0\r\n\r\nhi\r\nSUB a q 1\r\nUNSUB 1 5\r\nPONG\r\n",
        b"\x03\x01PUB  a\tb 3\nabc\r\nsub x 1\r\n",
        b"\x02\x05msg a 1 0\r\n\r\nhmsg a 1 16 16\r\nNATS/1.0 503\r\n\r\n\r\n",
    ];
    let mut rng = Rng::new(42);
    for _ in 0..2000 {
        let mut data = STREAMS[rng.below(STREAMS.len() as u64) as usize].to_vec();
        for _ in 0..rng.below(4) {
            let i = 2 + rng.below(data.len() as u64 - 2) as usize;
            data[i] = match rng.below(4) {
                0 => rng.next() as u8,
                1 => b' ',
                2 => b'\r',
                _ => b'\n',
            };
        }
        checks::check_parser(&data);
    }
}

#[test]
fn random_headers_and_subjects_hold_their_properties() {
    let mut rng = Rng::new(7);
    for _ in 0..3000 {
        let mut block = b"NATS/1.0".to_vec();
        block.extend(
            random_bytes(&mut rng, 40)
                .iter()
                .map(|b| b"ab :\r\n 4\t0"[*b as usize % 10]),
        );
        block.extend_from_slice(b"\r\n\r\n");
        checks::check_headers(&block);
        let s: Vec<u8> = random_bytes(&mut rng, 20)
            .iter()
            .map(|b| b"ab.*> \x00"[*b as usize % 7])
            .collect();
        checks::check_subject(&s);
    }
}
