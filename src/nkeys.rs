//! NKeys: Ed25519 keys in NATS' text encoding.
//!
//! A public key is `base32(prefix || 32 key bytes || crc16)`; a seed is
//! `base32(seed prefix bits + key-kind bits (2 bytes) || 32 seed bytes || crc16)`. Base32 is
//! RFC 4648 without padding, the checksum CRC-16/XMODEM (little endian). Every decode checks
//! length, alphabet, prefix and checksum, so a typo in a configured key is an error, never a
//! different key. Used for NATS authentication (signing the server's nonce), and for JWTs.

use ed25519_dalek::{Signature, Signer, SigningKey, VerifyingKey};
use std::fmt;

const PREFIX_SEED: u8 = 18 << 3; // 'S'
const PREFIX_PRIVATE: u8 = 15 << 3; // 'P'

/// What a key identifies; the first letter of its public form.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum KeyKind {
    Operator,
    Account,
    User,
    Server,
    Cluster,
}

impl KeyKind {
    fn prefix(self) -> u8 {
        match self {
            KeyKind::Operator => 14 << 3, // 'O'
            KeyKind::Account => 0,        // 'A'
            KeyKind::User => 20 << 3,     // 'U'
            KeyKind::Server => 13 << 3,   // 'N'
            KeyKind::Cluster => 2 << 3,   // 'C'
        }
    }

    fn from_prefix(prefix: u8) -> Option<KeyKind> {
        [
            KeyKind::Operator,
            KeyKind::Account,
            KeyKind::User,
            KeyKind::Server,
            KeyKind::Cluster,
        ]
        .into_iter()
        .find(|k| k.prefix() == prefix)
    }
}

/// Why a key, seed or signature was refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NkeyError {
    /// Not base32, or the wrong length.
    Encoding,
    /// The CRC-16 does not match: a mistyped or truncated key.
    Checksum,
    /// The prefix is not the expected one (e.g. a public key where a seed belongs).
    Prefix,
    /// A public key of another kind than required.
    WrongKind { expected: KeyKind, found: KeyKind },
    /// Bytes that are not a valid Ed25519 public key.
    InvalidKey,
    /// The signature does not verify, or is not 64 bytes.
    Signature,
    /// The operating system's random source failed.
    Random,
}

impl fmt::Display for NkeyError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            NkeyError::Encoding => f.write_str("nkey: invalid base32 encoding or length"),
            NkeyError::Checksum => f.write_str("nkey: checksum mismatch"),
            NkeyError::Prefix => f.write_str("nkey: invalid prefix byte"),
            NkeyError::WrongKind { expected, found } => {
                write!(
                    f,
                    "nkey: expected a {expected:?} key, found a {found:?} key"
                )
            }
            NkeyError::InvalidKey => f.write_str("nkey: not a valid Ed25519 public key"),
            NkeyError::Signature => f.write_str("nkey: signature verification failed"),
            NkeyError::Random => f.write_str("nkey: random source unavailable"),
        }
    }
}

impl std::error::Error for NkeyError {}

/// A signing key pair (from a seed). `Debug` never shows the seed.
#[derive(Clone)]
pub struct KeyPair {
    kind: KeyKind,
    signing: SigningKey,
}

impl fmt::Debug for KeyPair {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("KeyPair")
            .field("kind", &self.kind)
            .field("public_key", &self.public_key())
            .finish_non_exhaustive()
    }
}

impl KeyPair {
    /// A fresh key pair from the operating system's random source.
    pub fn generate(kind: KeyKind) -> Result<KeyPair, NkeyError> {
        let mut seed = [0u8; 32];
        getrandom::fill(&mut seed).map_err(|_| NkeyError::Random)?;
        Ok(KeyPair::from_raw_seed(kind, &seed))
    }

    pub fn from_raw_seed(kind: KeyKind, seed: &[u8; 32]) -> KeyPair {
        KeyPair {
            kind,
            signing: SigningKey::from_bytes(seed),
        }
    }

    /// Decodes an encoded seed (`S` + kind letter + ...).
    pub fn from_seed(text: &str) -> Result<KeyPair, NkeyError> {
        let raw = decode_checked(text.trim())?;
        let (b0, b1) = match raw.as_slice() {
            [b0, b1, ..] => (*b0, *b1),
            _ => return Err(NkeyError::Encoding),
        };
        if b0 & 0xf8 != PREFIX_SEED {
            return Err(NkeyError::Prefix);
        }
        let kind_prefix = ((b0 & 0x07) << 5) | ((b1 & 0xf8) >> 3);
        let kind = KeyKind::from_prefix(kind_prefix).ok_or(NkeyError::Prefix)?;
        let seed: [u8; 32] = raw
            .get(2..)
            .and_then(|s| s.try_into().ok())
            .ok_or(NkeyError::Encoding)?;
        Ok(KeyPair::from_raw_seed(kind, &seed))
    }

    pub fn kind(&self) -> KeyKind {
        self.kind
    }

    /// The encoded seed (secret).
    pub fn seed(&self) -> String {
        let prefix = self.kind.prefix();
        let mut raw = Vec::with_capacity(36);
        raw.push(PREFIX_SEED | (prefix >> 5));
        raw.push((prefix & 0x1f) << 3);
        raw.extend_from_slice(&self.signing.to_bytes());
        encode_checked(raw)
    }

    /// The encoded public key (`U...`, `A...`, `O...`, ...).
    pub fn public_key(&self) -> String {
        self.public().encode()
    }

    pub fn public(&self) -> PublicKey {
        PublicKey {
            kind: self.kind,
            key: self.signing.verifying_key(),
        }
    }

    /// The encoded private key (`P...`), the form some tools print.
    pub fn private_key(&self) -> String {
        let mut raw = Vec::with_capacity(67);
        raw.push(PREFIX_PRIVATE);
        raw.extend_from_slice(&self.signing.to_keypair_bytes());
        encode_checked(raw)
    }

    /// Ed25519 signature of `message`.
    pub fn sign(&self, message: &[u8]) -> [u8; 64] {
        self.signing.sign(message).to_bytes()
    }
}

/// A public key that can verify signatures.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PublicKey {
    kind: KeyKind,
    key: VerifyingKey,
}

impl PublicKey {
    /// Decodes an encoded public key of any kind.
    pub fn decode(text: &str) -> Result<PublicKey, NkeyError> {
        let raw = decode_checked(text.trim())?;
        let (prefix, key) = raw.split_first().ok_or(NkeyError::Encoding)?;
        let kind = KeyKind::from_prefix(*prefix).ok_or(NkeyError::Prefix)?;
        let key: &[u8; 32] = key.try_into().map_err(|_| NkeyError::Encoding)?;
        let key = VerifyingKey::from_bytes(key).map_err(|_| NkeyError::InvalidKey)?;
        Ok(PublicKey { kind, key })
    }

    /// Decodes an encoded public key and requires its kind.
    pub fn decode_kind(text: &str, expected: KeyKind) -> Result<PublicKey, NkeyError> {
        let key = PublicKey::decode(text)?;
        if key.kind != expected {
            return Err(NkeyError::WrongKind {
                expected,
                found: key.kind,
            });
        }
        Ok(key)
    }

    pub fn kind(&self) -> KeyKind {
        self.kind
    }

    pub fn encode(&self) -> String {
        let mut raw = Vec::with_capacity(35);
        raw.push(self.kind.prefix());
        raw.extend_from_slice(self.key.as_bytes());
        encode_checked(raw)
    }

    pub fn verify(&self, message: &[u8], signature: &[u8]) -> Result<(), NkeyError> {
        let signature = Signature::from_slice(signature).map_err(|_| NkeyError::Signature)?;
        // Strict: a small-order key or signature point is refused (with a weak key, one
        // signature verifies for many messages).
        self.key
            .verify_strict(message, &signature)
            .map_err(|_| NkeyError::Signature)
    }
}

impl fmt::Display for PublicKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.encode())
    }
}

/// True when `text` is a well-formed public key of `kind` (checksum included).
pub fn is_valid_public_key(text: &str, kind: KeyKind) -> bool {
    PublicKey::decode_kind(text, kind).is_ok()
}

fn encode_checked(mut raw: Vec<u8>) -> String {
    let crc = crc16(&raw);
    raw.extend_from_slice(&crc.to_le_bytes());
    base32_encode(&raw)
}

fn decode_checked(text: &str) -> Result<Vec<u8>, NkeyError> {
    let raw = base32_decode(text.as_bytes()).ok_or(NkeyError::Encoding)?;
    if raw.len() < 3 {
        return Err(NkeyError::Encoding);
    }
    let (body, crc) = raw.split_at(raw.len() - 2);
    let expected = u16::from_le_bytes([crc[0], crc[1]]);
    if crc16(body) != expected {
        return Err(NkeyError::Checksum);
    }
    Ok(body.to_vec())
}

/// CRC-16/XMODEM: polynomial 0x1021, initial value 0, no reflection.
pub fn crc16(data: &[u8]) -> u16 {
    let mut crc: u16 = 0;
    for &byte in data {
        crc ^= u16::from(byte) << 8;
        for _ in 0..8 {
            crc = if crc & 0x8000 != 0 {
                (crc << 1) ^ 0x1021
            } else {
                crc << 1
            };
        }
    }
    crc
}

/// RFC 4648 base32, no padding.
pub fn base32_encode(data: &[u8]) -> String {
    data_encoding::BASE32_NOPAD.encode(data)
}

/// RFC 4648 base32 without padding; `None` on a character outside the alphabet (lower case
/// included), a length no encoding has, or leftover bits that are not zero (a non-canonical
/// encoding), so each key has exactly one text form.
pub fn base32_decode(text: &[u8]) -> Option<Vec<u8>> {
    data_encoding::BASE32_NOPAD.decode(text).ok()
}

#[cfg(test)]
mod tests {
    use super::*;
    use base64::Engine;

    // A user seed and its public key from the NATS documentation and client test suites,
    // with the signature of the bytes "nonce" that the C client's tests pin.
    const SEED: &str = "SUAMK2FG4MI6UE3ACF3FK3OIQBCEIEZV7NSWFFEW63UXMRLFM2XLAXK4GY";
    const PUBLIC: &str = "UAT6BWCSCWLUKJT6K6MBJJOEOTXZ5AJDOYKNEVRFC7VNO6OA43N4TRNO";
    const NONCE_SIG: &str =
        "m50It12aTgfbJwsQhucujqhXbsq7tLM-Mf_hSjBQsG_4onm8y2Vkw6JG1bbcDkdxXe-Ng0K-7X9ov4rZ4wFcDg";

    #[test]
    fn known_user_seed_yields_its_documented_public_key() {
        let kp = KeyPair::from_seed(SEED).expect("seed");
        assert_eq!(kp.kind(), KeyKind::User);
        assert_eq!(kp.public_key(), PUBLIC);
        assert_eq!(kp.seed(), SEED);
    }

    #[test]
    fn known_seed_signs_nonce_to_the_known_signature() {
        let kp = KeyPair::from_seed(SEED).expect("seed");
        let sig = kp.sign(b"nonce");
        let encoded = base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(sig);
        assert_eq!(encoded, NONCE_SIG);
        let public = PublicKey::decode(PUBLIC).expect("public");
        public.verify(b"nonce", &sig).expect("verifies");
        assert_eq!(public.verify(b"other", &sig), Err(NkeyError::Signature));
    }

    #[test]
    fn crc16_xmodem_check_value() {
        assert_eq!(crc16(b"123456789"), 0x31c3);
    }

    #[test]
    fn a_small_order_key_verifies_nothing() {
        // The identity point as public key, and a signature of the identity point and a
        // zero scalar: the lax check holds for every message.
        let mut identity = [0u8; 32];
        identity[0] = 1;
        let weak = PublicKey {
            kind: KeyKind::User,
            key: VerifyingKey::from_bytes(&identity).expect("a point"),
        };
        let mut sig = [0u8; 64];
        sig[0] = 1;
        assert!(weak.verify(b"any message", &sig).is_err());
        assert!(weak.verify(b"another one", &sig).is_err());
    }

    #[test]
    fn base32_matches_rfc4648_vectors_without_padding() {
        for (plain, encoded) in [
            ("", ""),
            ("f", "MY"),
            ("fo", "MZXQ"),
            ("foo", "MZXW6"),
            ("foob", "MZXW6YQ"),
            ("fooba", "MZXW6YTB"),
            ("foobar", "MZXW6YTBOI"),
        ] {
            assert_eq!(base32_encode(plain.as_bytes()), encoded);
            assert_eq!(
                base32_decode(encoded.as_bytes()).as_deref(),
                Some(plain.as_bytes())
            );
        }
        assert_eq!(base32_decode(b"MZ1"), None);
        assert_eq!(base32_decode(b"mzxw6"), None);
    }

    #[test]
    fn base32_refuses_non_canonical_text() {
        // "MY" is "f"; "MZ" differs only in the unused low bit, and a key has one text form.
        assert_eq!(base32_decode(b"MZ"), None);
        // Lengths no encoding produces (1, 3 and 6 characters mod 8), and padding.
        for text in ["M", "MZX", "MZXW6Y", "MY======"] {
            assert_eq!(base32_decode(text.as_bytes()), None, "{text}");
        }
    }

    #[test]
    fn generated_keys_round_trip_for_every_kind() {
        for kind in [
            KeyKind::Operator,
            KeyKind::Account,
            KeyKind::User,
            KeyKind::Server,
            KeyKind::Cluster,
        ] {
            let kp = KeyPair::generate(kind).expect("generate");
            let seed = kp.seed();
            assert!(seed.starts_with('S'));
            let again = KeyPair::from_seed(&seed).expect("decode own seed");
            assert_eq!(again.kind(), kind);
            assert_eq!(again.public_key(), kp.public_key());
            let public = PublicKey::decode_kind(&kp.public_key(), kind).expect("public");
            public.verify(b"msg", &kp.sign(b"msg")).expect("verify");
            assert!(kp.private_key().starts_with('P'));
        }
        assert!(
            KeyPair::generate(KeyKind::Operator)
                .expect("generate")
                .public_key()
                .starts_with('O')
        );
    }

    #[test]
    fn corrupted_or_misplaced_keys_are_refused() {
        // One character changed: the checksum catches it.
        let mut bad = PUBLIC.to_string();
        bad.replace_range(10..11, if &PUBLIC[10..11] == "A" { "B" } else { "A" });
        assert!(matches!(
            PublicKey::decode(&bad),
            Err(NkeyError::Checksum | NkeyError::Encoding)
        ));
        assert!(KeyPair::from_seed("SUAMK2FG").is_err());
        assert_eq!(KeyPair::from_seed(PUBLIC).err(), Some(NkeyError::Prefix));
        assert_eq!(
            KeyPair::from_seed("SUAMK2FG4MI6UE3ACF3FK3OIQBCEIEZV7NSWFFEW63UXMRLFM2XLAXK4!Y").err(),
            Some(NkeyError::Encoding)
        );
        assert_eq!(
            PublicKey::decode_kind(PUBLIC, KeyKind::Account).err(),
            Some(NkeyError::WrongKind {
                expected: KeyKind::Account,
                found: KeyKind::User
            })
        );
        assert!(is_valid_public_key(PUBLIC, KeyKind::User));
        assert!(!is_valid_public_key(SEED, KeyKind::User));
    }
}
