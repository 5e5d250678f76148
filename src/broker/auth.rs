//! Checking the credential of a `hello` against the participant's configuration: a token
//! (compared as SHA-256 in constant time) or an NKey signature of the challenge nonce.
//! The answer is only yes or no, so a failure never says which part was wrong.
//!
//! Nor does the time it takes: the cryptography ([`present`]) sees only what the client
//! sent, never the configuration, so an unknown participant costs the same SHA-256 or
//! Ed25519 verification as a known one with a wrong credential; the comparison with the
//! configuration ([`accepts`]) is constant-time against the participant's values or, for
//! an unknown one, fixed dummies of the same length.

use base64::Engine;
use base64::engine::general_purpose::{URL_SAFE, URL_SAFE_NO_PAD};
use sha2::{Digest, Sha256};

use super::config::Participant;
use crate::nkeys::{KeyKind, PublicKey};

/// A credential as presented in `hello.auth`.
#[derive(Debug, Clone, Copy)]
pub enum Credential<'a> {
    Token(&'a str),
    NKey { nkey: &'a str, sig: &'a str },
}

/// What the client proved, before looking at who it claims to be.
#[derive(Debug, Clone, Copy)]
pub enum Presented<'a> {
    /// The SHA-256 of the token, as lowercase hex.
    Token([u8; 64]),
    /// The key presented and whether it signed this session's nonce.
    NKey { nkey: &'a str, signed: bool },
}

/// Stands in for the configured values of an unknown participant (or one configured with
/// the other kind of credential): same lengths, never equal to anything presented (no
/// token hashes to all zeros; the key is not a valid public key's text).
const DUMMY_TOKEN_SHA256: &[u8; 64] = &[b'0'; 64];
const DUMMY_NKEY: &str = "U0000000000000000000000000000000000000000000000000000000";
/// A valid user key for the Ed25519 work when the presented key does not decode.
const FALLBACK_KEY: &str = "UDXU4RCSJNZOIQHZNWXHXORDPRTGNJAHAHFRGZNEEJCPQTT2M7NLCNF4";

/// Whether `credential` proves the identity of `participant` (`None`: not configured)
/// for a session whose challenge was `nonce`.
pub fn verify(participant: Option<&Participant>, credential: Credential<'_>, nonce: &[u8]) -> bool {
    accepts(participant, &present(credential, nonce))
}

/// The cryptographic work of a check; it depends only on what the client sent.
pub fn present<'a>(credential: Credential<'a>, nonce: &[u8]) -> Presented<'a> {
    match credential {
        Credential::Token(token) => {
            count_work();
            let digest = Sha256::digest(token.as_bytes());
            let mut hex = [0u8; 64];
            for (i, b) in digest.iter().enumerate() {
                hex[2 * i] = HEX[usize::from(b >> 4)];
                hex[2 * i + 1] = HEX[usize::from(b & 15)];
            }
            Presented::Token(hex)
        }
        Credential::NKey { nkey, sig } => {
            let key = PublicKey::decode_kind(nkey, KeyKind::User);
            let signature = decode_base64url(sig);
            let decoded = key.is_ok() && signature.is_some();
            // Malformed input still pays for one verification, so it is not a shortcut.
            let key = key.or_else(|_| PublicKey::decode_kind(FALLBACK_KEY, KeyKind::User));
            let signature = signature.unwrap_or_else(|| vec![0u8; 64]);
            count_work();
            let verified = key.is_ok_and(|k| k.verify(nonce, &signature).is_ok());
            Presented::NKey {
                nkey,
                signed: decoded && verified,
            }
        }
    }
}

/// Whether what was presented matches `participant`'s configured credential.
pub fn accepts(participant: Option<&Participant>, presented: &Presented<'_>) -> bool {
    match presented {
        Presented::Token(hex) => {
            let configured = participant.and_then(|p| p.token_sha256.as_deref());
            let expected = configured.map_or_else(
                || DUMMY_TOKEN_SHA256.to_vec(),
                |h| h.to_ascii_lowercase().into_bytes(),
            );
            let equal = constant_time_eq(hex, &expected);
            equal & configured.is_some()
        }
        Presented::NKey { nkey, signed } => {
            let configured = participant.and_then(|p| p.nkey.as_deref());
            let equal =
                constant_time_eq(nkey.as_bytes(), configured.unwrap_or(DUMMY_NKEY).as_bytes());
            equal & *signed & configured.is_some()
        }
    }
}

#[cfg(test)]
thread_local! {
    static WORK: std::cell::Cell<u32> = const { std::cell::Cell::new(0) };
}

/// Counts hash and signature checks in unit tests, to show both paths do the same work.
fn count_work() {
    #[cfg(test)]
    WORK.with(|w| w.set(w.get() + 1));
}

const HEX: &[u8; 16] = b"0123456789abcdef";

/// Base64url with or without padding, as the spec allows for signatures.
pub fn decode_base64url(text: &str) -> Option<Vec<u8>> {
    if text.ends_with('=') {
        URL_SAFE.decode(text).ok()
    } else {
        URL_SAFE_NO_PAD.decode(text).ok()
    }
}

/// Compares without an early exit, so the time taken does not tell how much matched.
pub fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    let diff = a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y));
    std::hint::black_box(diff) == 0
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::nkeys::KeyPair;

    fn participant(nkey: Option<String>, token_sha256: Option<String>) -> Participant {
        Participant {
            nkey,
            token_sha256,
            permissions: Default::default(),
            labels: Default::default(),
            policy: None,
        }
    }

    #[test]
    fn token_is_checked_against_its_sha256() {
        // sha256("s3cret")
        let p = participant(
            None,
            Some("1ec1c26b50d5d3c58d9583181af8076655fe00756bf7285940ba3670f99fcba0".into()),
        );
        assert!(verify(Some(&p), Credential::Token("s3cret"), b"n"));
        assert!(!verify(Some(&p), Credential::Token("s3cret "), b"n"));
        assert!(!verify(Some(&p), Credential::Token(""), b"n"));
        let upper = participant(None, p.token_sha256.as_ref().map(|h| h.to_uppercase()));
        assert!(
            verify(Some(&upper), Credential::Token("s3cret"), b"n"),
            "hex case does not matter"
        );
    }

    #[test]
    fn nkey_signature_must_cover_this_sessions_nonce() {
        let kp = KeyPair::generate(KeyKind::User).expect("keygen");
        let p = participant(Some(kp.public_key()), None);
        let nonce = [7u8; 32];
        let sig = URL_SAFE_NO_PAD.encode(kp.sign(&nonce));
        let padded = URL_SAFE.encode(kp.sign(&nonce));
        let nkey = kp.public_key();
        assert!(verify(
            Some(&p),
            Credential::NKey {
                nkey: &nkey,
                sig: &sig
            },
            &nonce
        ));
        assert!(verify(
            Some(&p),
            Credential::NKey {
                nkey: &nkey,
                sig: &padded
            },
            &nonce
        ));
        assert!(
            !verify(
                Some(&p),
                Credential::NKey {
                    nkey: &nkey,
                    sig: &sig
                },
                &[8u8; 32]
            ),
            "another nonce"
        );
        let other = KeyPair::generate(KeyKind::User).expect("keygen");
        let other_key = other.public_key();
        let other_sig = URL_SAFE_NO_PAD.encode(other.sign(&nonce));
        assert!(
            !verify(
                Some(&p),
                Credential::NKey {
                    nkey: &other_key,
                    sig: &other_sig
                },
                &nonce
            ),
            "another key"
        );
        assert!(!verify(
            Some(&p),
            Credential::NKey {
                nkey: &nkey,
                sig: "not base64!"
            },
            &nonce
        ));
        assert!(
            !verify(Some(&p), Credential::Token("x"), &nonce),
            "a token for an nkey participant"
        );
    }

    #[test]
    fn an_unknown_participant_costs_the_same_verification_as_a_wrong_credential() {
        let kp = KeyPair::generate(KeyKind::User).expect("keygen");
        let known = participant(Some(kp.public_key()), None);
        let by_token = participant(None, Some("ab".repeat(32)));
        let nonce = [7u8; 32];
        let nkey = kp.public_key();
        let wrong_sig = URL_SAFE_NO_PAD.encode([1u8; 64]);
        let work = |p: Option<&Participant>, c: Credential<'_>| {
            let before = WORK.with(|w| w.get());
            assert!(!verify(p, c, &nonce));
            WORK.with(|w| w.get()) - before
        };
        let nkey_cred = Credential::NKey {
            nkey: &nkey,
            sig: &wrong_sig,
        };
        let garbage = Credential::NKey {
            nkey: "not a key",
            sig: "not base64!",
        };
        let cases = [
            (work(Some(&known), nkey_cred), "known, wrong signature"),
            (work(None, nkey_cred), "unknown, nkey"),
            (work(Some(&by_token), nkey_cred), "token participant, nkey"),
            (work(None, garbage), "unknown, malformed"),
            (
                work(Some(&by_token), Credential::Token("x")),
                "known, wrong token",
            ),
            (work(None, Credential::Token("x")), "unknown, token"),
            (
                work(Some(&known), Credential::Token("x")),
                "nkey participant, token",
            ),
        ];
        for (n, case) in cases {
            assert_eq!(n, 1, "one hash or signature check: {case}");
        }
    }

    /// The figure behind the claim: median time of a refused check, unknown participant vs
    /// known participant with a wrong credential, sampled interleaved.
    #[test]
    fn refused_checks_take_as_long_for_unknown_participants() {
        let kp = KeyPair::generate(KeyKind::User).expect("keygen");
        let known = participant(Some(kp.public_key()), None);
        let nonce = [7u8; 32];
        let nkey = kp.public_key();
        let wrong_sig = URL_SAFE_NO_PAD.encode(kp.sign(&[8u8; 32]));
        let cred = Credential::NKey {
            nkey: &nkey,
            sig: &wrong_sig,
        };
        let time = |p: Option<&Participant>| {
            let t = std::time::Instant::now();
            std::hint::black_box(verify(p, cred, &nonce));
            t.elapsed()
        };
        let (mut unknown, mut wrong) = (Vec::new(), Vec::new());
        for _ in 0..21 {
            unknown.push(time(None));
            wrong.push(time(Some(&known)));
        }
        unknown.sort();
        wrong.sort();
        let (u, w) = (unknown[10], wrong[10]);
        eprintln!("median refused hello check: unknown {u:?}, known with a wrong signature {w:?}");
        let ratio = u.as_secs_f64() / w.as_secs_f64();
        assert!((0.5..2.0).contains(&ratio), "unknown {u:?} vs known {w:?}");
    }

    #[test]
    fn constant_time_eq_compares_whole_slices() {
        assert!(constant_time_eq(b"abc", b"abc"));
        assert!(!constant_time_eq(b"abc", b"abd"));
        assert!(!constant_time_eq(b"abc", b"ab"));
    }
}
