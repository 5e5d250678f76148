// Checks for the identity fuzz targets (fuzz/fuzz_targets/jwt.rs, nkey.rs), shared with the
// regression replay in tests/fuzz_identity_regressions.rs. Each panics when a property does
// not hold; decoding itself must never panic on any input.

#![allow(dead_code)]

use std::sync::OnceLock;
use std::time::Instant;

use amp_broker::broker::callout::{Callout, CalloutConfig, Outcome};
use amp_broker::broker::config::Config;
use amp_broker::broker::scoped_jwt;
use amp_broker::jwt::{self, Claims};
use amp_broker::nkeys::{self, KeyKind, KeyPair, PublicKey};

const NOW: u64 = 1_800_000_000;

struct Fixture {
    server: KeyPair,
    account: KeyPair,
    config: Config,
}

fn fixture() -> &'static Fixture {
    static F: OnceLock<Fixture> = OnceLock::new();
    F.get_or_init(|| {
        let user = KeyPair::from_raw_seed(KeyKind::User, &[3; 32]);
        let json = format!(
            r#"{{"namespaces":{{"acme":{{"participants":{{
                "w1":{{"token_sha256":"1ec1c26b50d5d3c58d9583181af8076655fe00756bf7285940ba3670f99fcba0","permissions":{{"publish":["a.>"]}}}},
                "w2":{{"nkey":"{}"}}}}}}}}}}"#,
            user.public_key()
        );
        Fixture {
            server: KeyPair::from_raw_seed(KeyKind::Server, &[1; 32]),
            account: KeyPair::from_raw_seed(KeyKind::Account, &[2; 32]),
            config: Config::parse(json.as_bytes()).expect("fixture configuration"),
        }
    })
}

/// The first byte picks the mode:
/// - even: the rest is a token, decoded as a JWT, a user JWT and an authorization request;
/// - odd: the rest is claims JSON, signed by the fixture's server key, so the callout's
///   claim handling past the signature check is reached.
pub fn check_jwt(data: &[u8]) {
    let Some((&mode, rest)) = data.split_first() else {
        return;
    };
    let f = fixture();
    let mut config = CalloutConfig::new(f.account.clone());
    // Pinned, so claims signed by the fixture's server reach the checks past the trust one.
    config.trusted_servers = vec![f.server.public_key()];
    let mut callout = Callout::new(config);
    if mode & 1 == 0 {
        let text = String::from_utf8_lossy(rest);
        if let Ok(decoded) = jwt::decode(&text) {
            // The key that verified is the one `iss` names.
            let iss = decoded.claims.get("iss").and_then(|v| v.as_str());
            assert_eq!(iss.map(str::trim), Some(decoded.issuer.encode().as_str()));
        }
        if let Ok(user) = scoped_jwt::verify_user(&text, &f.account.public_key(), NOW) {
            assert_eq!(user.user_key.kind(), KeyKind::User);
        }
        let reply = callout.handle(&f.config, None, rest, Instant::now(), NOW);
        if let Outcome::BadRequest { .. } = reply.outcome {
            assert!(reply.payload.is_empty());
        }
    } else {
        let Ok(claims) = serde_json::from_slice::<Claims>(rest) else {
            return;
        };
        let Ok(token) = jwt::encode(&claims, &f.server) else {
            return;
        };
        let reply = callout.handle(&f.config, None, token.as_bytes(), Instant::now(), NOW);
        match reply.outcome {
            Outcome::BadRequest { .. } | Outcome::Shed => assert!(reply.payload.is_empty()),
            Outcome::Authorized { .. } | Outcome::Refused { .. } => {
                // Every answer to a well-formed request is a response signed by the account.
                let text = std::str::from_utf8(&reply.payload).expect("response is text");
                let response = jwt::decode(text).expect("response verifies");
                assert_eq!(response.issuer.encode(), f.account.public_key());
            }
        }
    }
}

/// Public keys, seeds and raw base32 from arbitrary text: no panics; an accepted public
/// key re-encodes to exactly its text (one spelling per key), and an accepted seed
/// re-encodes to a seed of the same key; base32 is canonical.
pub fn check_nkey(data: &[u8]) {
    let text = String::from_utf8_lossy(data);
    if let Ok(key) = PublicKey::decode(&text) {
        assert_eq!(key.encode(), text.trim());
        assert!(PublicKey::decode_kind(&text, key.kind()).is_ok());
        let _ = key.verify(data, data);
    }
    if let Ok(pair) = KeyPair::from_seed(&text) {
        let again = KeyPair::from_seed(&pair.seed()).expect("re-encoded seed decodes");
        assert_eq!(again.public_key(), pair.public_key());
        assert_eq!(again.kind(), pair.kind());
    }
    if let Some(raw) = nkeys::base32_decode(data) {
        // Only canonical encodings are accepted: one spelling per byte string.
        assert_eq!(nkeys::base32_encode(&raw).as_bytes(), data);
    }
    let _ = nkeys::crc16(data);
}
