//! Checking the credential of a `hello` against the participant's configuration: a token
//! (compared as SHA-256 in constant time) or an NKey signature of the challenge nonce.
//! The answer is only yes or no, so a failure never says which part was wrong.

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

/// Whether `credential` proves the identity of `participant` for a session whose
/// challenge was `nonce`.
pub fn verify(participant: &Participant, credential: Credential<'_>, nonce: &[u8]) -> bool {
    match credential {
        Credential::Token(token) => {
            let Some(expected) = participant.token_sha256.as_deref() else {
                return false;
            };
            let digest = Sha256::digest(token.as_bytes());
            let mut presented = [0u8; 64];
            for (i, b) in digest.iter().enumerate() {
                presented[2 * i] = HEX[usize::from(b >> 4)];
                presented[2 * i + 1] = HEX[usize::from(b & 15)];
            }
            constant_time_eq(&presented, expected.to_ascii_lowercase().as_bytes())
        }
        Credential::NKey { nkey, sig } => {
            if participant.nkey.as_deref() != Some(nkey) {
                return false;
            }
            let Ok(key) = PublicKey::decode_kind(nkey, KeyKind::User) else {
                return false;
            };
            let Some(signature) = decode_base64url(sig) else {
                return false;
            };
            key.verify(nonce, &signature).is_ok()
        }
    }
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
        assert!(verify(&p, Credential::Token("s3cret"), b"n"));
        assert!(!verify(&p, Credential::Token("s3cret "), b"n"));
        assert!(!verify(&p, Credential::Token(""), b"n"));
        let upper = participant(None, p.token_sha256.as_ref().map(|h| h.to_uppercase()));
        assert!(
            verify(&upper, Credential::Token("s3cret"), b"n"),
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
            &p,
            Credential::NKey {
                nkey: &nkey,
                sig: &sig
            },
            &nonce
        ));
        assert!(verify(
            &p,
            Credential::NKey {
                nkey: &nkey,
                sig: &padded
            },
            &nonce
        ));
        assert!(
            !verify(
                &p,
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
                &p,
                Credential::NKey {
                    nkey: &other_key,
                    sig: &other_sig
                },
                &nonce
            ),
            "another key"
        );
        assert!(!verify(
            &p,
            Credential::NKey {
                nkey: &nkey,
                sig: "not base64!"
            },
            &nonce
        ));
        assert!(
            !verify(&p, Credential::Token("x"), &nonce),
            "a token for an nkey participant"
        );
    }

    #[test]
    fn constant_time_eq_compares_whole_slices() {
        assert!(constant_time_eq(b"abc", b"abc"));
        assert!(!constant_time_eq(b"abc", b"abd"));
        assert!(!constant_time_eq(b"abc", b"ab"));
    }
}
