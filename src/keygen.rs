//! `amp-broker keygen`: a new participant credential, in both forms the configuration
//! accepts. The NKey seed (or the token) goes to the participant; the configuration keeps
//! only the public key (or the token's SHA-256).

use sha2::{Digest, Sha256};

use crate::nkeys::{KeyKind, KeyPair, NkeyError};

/// A freshly generated credential pair.
#[derive(Debug, Clone)]
pub struct Generated {
    /// `SU...`: secret, for the participant.
    pub seed: String,
    /// `U...`: for the configuration's `nkey`.
    pub public_key: String,
    /// 32 random bytes as base64url: secret, for the participant.
    pub token: String,
    /// For the configuration's `token_sha256`.
    pub token_sha256: String,
}

pub fn generate() -> Result<Generated, NkeyError> {
    let key = KeyPair::generate(KeyKind::User)?;
    let mut raw = [0u8; 32];
    getrandom::fill(&mut raw).map_err(|_| NkeyError::Random)?;
    let token = base64url(&raw);
    Ok(Generated {
        seed: key.seed(),
        public_key: key.public_key(),
        token_sha256: token_sha256(&token),
        token,
    })
}

/// The lowercase hex SHA-256 of a token, as `token_sha256` stores it.
pub fn token_sha256(token: &str) -> String {
    Sha256::digest(token.as_bytes())
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

fn base64url(bytes: &[u8]) -> String {
    use base64::Engine;
    base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(bytes)
}

/// The text `amp-broker keygen` prints.
pub fn keygen_text() -> Result<String, NkeyError> {
    Ok(render(&generate()?))
}

pub fn render(g: &Generated) -> String {
    format!(
        "# A new participant credential. Use ONE of the two forms.\n\
         #\n\
         # NKey: give the seed to the participant (it signs the challenge with it);\n\
         # put the public key in the configuration.\n\
         seed:         {seed}\n\
         public key:   {public_key}\n\
         config:       \"nkey\": \"{public_key}\"\n\
         #\n\
         # Token: give the token to the participant; the configuration keeps its SHA-256.\n\
         token:        {token}\n\
         token_sha256: {token_sha256}\n\
         config:       \"token_sha256\": \"{token_sha256}\"\n",
        seed = g.seed,
        public_key = g.public_key,
        token = g.token,
        token_sha256 = g.token_sha256,
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::broker::config::Config;
    use crate::nkeys::PublicKey;

    #[test]
    fn the_seed_signs_for_the_printed_public_key() {
        let g = generate().expect("keygen");
        let key = KeyPair::from_seed(&g.seed).expect("seed decodes");
        assert_eq!(key.kind(), KeyKind::User);
        assert_eq!(key.public_key(), g.public_key);
        let public = PublicKey::decode_kind(&g.public_key, KeyKind::User).expect("public key");
        assert!(public.verify(b"nonce", &key.sign(b"nonce")).is_ok());
    }

    #[test]
    fn the_token_hash_is_its_sha256_hex_and_tokens_differ() {
        let g = generate().expect("keygen");
        assert_eq!(g.token_sha256, token_sha256(&g.token));
        assert_eq!(g.token.len(), 43);
        assert_eq!(
            token_sha256("s3cret"),
            "1ec1c26b50d5d3c58d9583181af8076655fe00756bf7285940ba3670f99fcba0"
        );
        assert_ne!(generate().expect("keygen").token, g.token);
    }

    #[test]
    fn printed_config_lines_are_accepted_by_the_configuration() {
        let g = generate().expect("keygen");
        let text = render(&g);
        assert!(text.contains(&g.seed) && text.contains(&g.token));
        for line in text.lines().filter(|l| l.starts_with("config:")) {
            let member = line.trim_start_matches("config:").trim();
            let json =
                format!(r#"{{"namespaces":{{"acme":{{"participants":{{"w1":{{{member}}}}}}}}}}}"#);
            Config::parse(json.as_bytes()).unwrap_or_else(|e| panic!("{json}: {e}"));
        }
    }
}
