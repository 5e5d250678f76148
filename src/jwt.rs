//! NATS JWTs (v2): claims signed with an NKey.
//!
//! Wire form: `base64url(header) . base64url(claims) . base64url(ed25519 signature)`, no
//! padding, header `{"typ":"JWT","alg":"ed25519-nkey"}`. The signature covers the first two
//! parts as text. `jti` is the base32 (no padding) SHA-512/256 of the claims serialised without
//! a `jti`, so a claims set names itself. The signer's public key is the `iss` claim, which
//! is how [`decode`] finds the key to verify with.

use crate::nkeys::{KeyPair, NkeyError, PublicKey, base32_encode};
use base64::Engine;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use serde_json::{Map, Value, json};
use sha2::{Digest, Sha512_256};
use std::fmt;

pub const HEADER_TYPE: &str = "JWT";
pub const HEADER_ALG: &str = "ed25519-nkey";
/// The v1 algorithm name, still accepted when decoding.
pub const HEADER_ALG_V1: &str = "ed25519";

/// Largest token [`decode`] looks at; real ones are a few kilobytes.
pub const MAX_TOKEN_LEN: usize = 64 * 1024;

pub type Claims = Map<String, Value>;

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum JwtError {
    /// Not three base64url parts of JSON objects, or too long.
    Format(&'static str),
    /// The header names another type or algorithm.
    Header(String),
    /// `iss` missing or not a public key.
    Issuer(NkeyError),
    /// The signature does not verify with the issuer's key.
    Signature,
    Json(String),
}

impl fmt::Display for JwtError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            JwtError::Format(what) => write!(f, "jwt: malformed token: {what}"),
            JwtError::Header(h) => write!(f, "jwt: unsupported header {h}"),
            JwtError::Issuer(e) => write!(f, "jwt: bad issuer: {e}"),
            JwtError::Signature => f.write_str("jwt: signature does not verify"),
            JwtError::Json(e) => write!(f, "jwt: {e}"),
        }
    }
}

impl std::error::Error for JwtError {}

/// Signs `claims` with `issuer`: sets `iss` to the issuer's public key, `iat` to now unless
/// present, and `jti` to the claims' hash.
pub fn encode(claims: &Claims, issuer: &KeyPair) -> Result<String, JwtError> {
    let mut claims = claims.clone();
    claims.remove("jti");
    claims.insert("iss".into(), Value::String(issuer.public_key()));
    if !claims.contains_key("iat") {
        claims.insert("iat".into(), json!(unix_now()));
    }
    let unhashed = serde_json::to_vec(&claims).map_err(|e| JwtError::Json(e.to_string()))?;
    let jti = base32_encode(&Sha512_256::digest(&unhashed));
    claims.insert("jti".into(), Value::String(jti));

    let header = json!({"typ": HEADER_TYPE, "alg": HEADER_ALG});
    let header = serde_json::to_vec(&header).map_err(|e| JwtError::Json(e.to_string()))?;
    let body = serde_json::to_vec(&claims).map_err(|e| JwtError::Json(e.to_string()))?;
    let mut token = URL_SAFE_NO_PAD.encode(header);
    token.push('.');
    token.push_str(&URL_SAFE_NO_PAD.encode(body));
    let signature = issuer.sign(token.as_bytes());
    token.push('.');
    token.push_str(&URL_SAFE_NO_PAD.encode(signature));
    Ok(token)
}

/// A verified token.
#[derive(Debug, Clone, PartialEq)]
pub struct Decoded {
    pub header: Claims,
    pub claims: Claims,
    /// The issuer's key, which the signature was verified with.
    pub issuer: PublicKey,
}

impl Decoded {
    pub fn subject(&self) -> Option<&str> {
        self.claims.get("sub").and_then(Value::as_str)
    }

    /// `nats.type`: "operator", "account", "user", ...
    pub fn claim_type(&self) -> Option<&str> {
        self.claims
            .get("nats")
            .and_then(|n| n.get("type"))
            .and_then(Value::as_str)
    }

    /// `exp` in Unix seconds, when set.
    pub fn expires(&self) -> Option<i64> {
        self.claims.get("exp").and_then(Value::as_i64)
    }
}

/// Parses a token and verifies its signature with the key named by its `iss` claim. Expiry
/// and the issuer's authority are the caller's policy; this only proves who signed what.
pub fn decode(token: &str) -> Result<Decoded, JwtError> {
    let token = token.trim();
    if token.len() > MAX_TOKEN_LEN {
        return Err(JwtError::Format("token too long"));
    }
    let mut parts = token.split('.');
    let (Some(h), Some(c), Some(s), None) =
        (parts.next(), parts.next(), parts.next(), parts.next())
    else {
        return Err(JwtError::Format("expected three parts"));
    };
    let header: Claims = decode_part(h)?;
    let claims: Claims = decode_part(c)?;
    let signature = URL_SAFE_NO_PAD
        .decode(s)
        .map_err(|_| JwtError::Format("signature is not base64url"))?;
    let typ = header.get("typ").and_then(Value::as_str).unwrap_or("");
    let alg = header.get("alg").and_then(Value::as_str).unwrap_or("");
    if !typ.eq_ignore_ascii_case(HEADER_TYPE) || !(alg == HEADER_ALG || alg == HEADER_ALG_V1) {
        return Err(JwtError::Header(format!("typ={typ} alg={alg}")));
    }
    let iss = claims
        .get("iss")
        .and_then(Value::as_str)
        .ok_or(JwtError::Issuer(NkeyError::Encoding))?;
    let issuer = PublicKey::decode(iss).map_err(JwtError::Issuer)?;
    let signed_len = h.len() + 1 + c.len();
    let signed = token
        .get(..signed_len)
        .ok_or(JwtError::Format("truncated"))?;
    issuer
        .verify(signed.as_bytes(), &signature)
        .map_err(|_| JwtError::Signature)?;
    Ok(Decoded {
        header,
        claims,
        issuer,
    })
}

fn decode_part(part: &str) -> Result<Claims, JwtError> {
    let bytes = URL_SAFE_NO_PAD
        .decode(part)
        .map_err(|_| JwtError::Format("part is not base64url"))?;
    serde_json::from_slice(&bytes).map_err(|e| JwtError::Json(e.to_string()))
}

fn unix_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

fn object(value: Value) -> Claims {
    match value {
        Value::Object(map) => map,
        _ => Claims::new(),
    }
}

/// Self-signed operator claims (encode with the operator's own key).
pub fn operator_claims(operator_public: &str, name: &str) -> Claims {
    object(json!({
        "sub": operator_public,
        "name": name,
        "nats": {"type": "operator", "version": 2},
    }))
}

/// Account claims with no limits, JetStream included (encode with the operator's key).
pub fn account_claims(account_public: &str, name: &str) -> Claims {
    account_claims_with(account_public, name, true)
}

/// Claims for the system account: no limits and no JetStream, which the system account
/// may not have.
pub fn system_account_claims(account_public: &str, name: &str) -> Claims {
    account_claims_with(account_public, name, false)
}

fn account_claims_with(account_public: &str, name: &str, jetstream: bool) -> Claims {
    let mut limits = json!({
        "subs": -1, "data": -1, "payload": -1, "imports": -1, "exports": -1,
        "wildcards": true, "conn": -1, "leaf": -1,
    });
    if let (true, Some(map)) = (jetstream, limits.as_object_mut()) {
        for key in ["mem_storage", "disk_storage", "streams", "consumer"] {
            map.insert(key.into(), json!(-1));
        }
    }
    object(json!({
        "sub": account_public,
        "name": name,
        "nats": {"type": "account", "version": 2, "limits": limits},
    }))
}

/// User claims with no limits and no permission restrictions (encode with the account's
/// key, or with one of its signing keys and `issuer_account` set to the account).
pub fn user_claims(user_public: &str, name: &str, issuer_account: Option<&str>) -> Claims {
    let mut nats = json!({
        "type": "user",
        "version": 2,
        "pub": {},
        "sub": {},
        "subs": -1,
        "data": -1,
        "payload": -1,
    });
    if let (Some(account), Some(map)) = (issuer_account, nats.as_object_mut()) {
        map.insert("issuer_account".into(), Value::String(account.into()));
    }
    object(json!({"sub": user_public, "name": name, "nats": nats}))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::nkeys::KeyKind;

    #[test]
    fn encoded_token_decodes_and_verifies_with_its_issuer() {
        let operator = KeyPair::generate(KeyKind::Operator).expect("key");
        let account = KeyPair::generate(KeyKind::Account).expect("key");
        let token = encode(&account_claims(&account.public_key(), "A"), &operator).expect("jwt");
        let decoded = decode(&token).expect("decode");
        assert_eq!(decoded.issuer.encode(), operator.public_key());
        assert_eq!(decoded.subject(), Some(account.public_key().as_str()));
        assert_eq!(decoded.claim_type(), Some("account"));
        assert_eq!(
            decoded.header.get("alg").and_then(Value::as_str),
            Some(HEADER_ALG)
        );
        assert!(decoded.claims.get("iat").and_then(Value::as_u64).is_some());
    }

    #[test]
    fn jti_is_the_base32_sha512_256_of_the_claims_without_jti() {
        let operator = KeyPair::generate(KeyKind::Operator).expect("key");
        let mut claims = operator_claims(&operator.public_key(), "O");
        claims.insert("iat".into(), json!(1_700_000_000u64));
        let token = encode(&claims, &operator).expect("jwt");
        let mut decoded = decode(&token).expect("decode").claims;
        let jti = decoded.remove("jti").expect("jti");
        let expected = base32_encode(&Sha512_256::digest(
            serde_json::to_vec(&decoded).expect("json"),
        ));
        assert_eq!(jti, Value::String(expected));
        assert_eq!(jti.as_str().map(str::len), Some(52));
    }

    #[test]
    fn tampered_claims_or_signature_are_refused() {
        let account = KeyPair::generate(KeyKind::Account).expect("key");
        let user = KeyPair::generate(KeyKind::User).expect("key");
        let token = encode(&user_claims(&user.public_key(), "u", None), &account).expect("jwt");
        let parts: Vec<&str> = token.split('.').collect();
        let forged_claims = URL_SAFE_NO_PAD.encode(
            serde_json::to_vec(&json!({"iss": account.public_key(), "sub": "UOTHER"}))
                .expect("json"),
        );
        let forged = format!("{}.{}.{}", parts[0], forged_claims, parts[2]);
        assert_eq!(decode(&forged), Err(JwtError::Signature));
        assert!(matches!(decode("a.b"), Err(JwtError::Format(_))));
        assert!(matches!(decode("!!.??.**"), Err(JwtError::Format(_))));
    }
}
