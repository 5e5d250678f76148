//! The `.creds` file: a user JWT and its NKey seed, each framed by dashed marker lines.
//!
//! ```text
//! -----BEGIN NATS USER JWT-----
//! eyJ0eXAiOi...
//! ------END NATS USER JWT------
//!
//! ************************* IMPORTANT *************************
//! ...
//! -----BEGIN USER NKEY SEED-----
//! SUAM...
//! ------END USER NKEY SEED------
//! ```
//! The first framed block is the JWT, the second the seed; text outside blocks is ignored.

use super::error::Error;
use crate::nkeys::{KeyKind, KeyPair};

/// Larger files are refused before reading; real ones are a few kilobytes.
pub const MAX_CREDS_FILE: u64 = 64 * 1024;

fn is_marker(line: &str) -> bool {
    line.len() >= 6 && line.starts_with("---") && line.ends_with("---")
}

/// The framed blocks of a creds-style text, in order.
fn blocks(text: &str) -> Vec<&str> {
    let lines: Vec<&str> = text.lines().map(str::trim).collect();
    let mut out = Vec::new();
    let mut i = 0;
    while i < lines.len() {
        match (lines.get(i), lines.get(i + 1), lines.get(i + 2)) {
            (Some(open), Some(body), Some(close))
                if is_marker(open) && !body.is_empty() && !is_marker(body) && is_marker(close) =>
            {
                out.push(*body);
                i += 3;
            }
            _ => i += 1,
        }
    }
    out
}

/// Parses creds text into the user JWT and the user's key pair.
pub fn parse(text: &str) -> Result<(String, KeyPair), Error> {
    let blocks = blocks(text);
    let (Some(jwt), Some(seed)) = (blocks.first(), blocks.get(1)) else {
        return Err(Error::Credentials(
            "creds: expected a framed user JWT followed by a framed NKey seed".into(),
        ));
    };
    if jwt.split('.').count() != 3 {
        return Err(Error::Credentials("creds: first block is not a JWT".into()));
    }
    let key =
        KeyPair::from_seed(seed).map_err(|e| Error::Credentials(format!("creds: seed: {e}")))?;
    if key.kind() != KeyKind::User {
        return Err(Error::Credentials(format!(
            "creds: seed is for a {:?} key, not a user",
            key.kind()
        )));
    }
    Ok((jwt.to_string(), key))
}

/// Writes the standard creds file text for a user JWT and seed.
pub fn format(jwt: &str, seed: &str) -> String {
    format!(
        "-----BEGIN NATS USER JWT-----\n{jwt}\n------END NATS USER JWT------\n\n\
         ************************* IMPORTANT *************************\n\
         NKEY Seed printed below can be used to sign and prove identity.\n\
         NKEYs are sensitive and should be treated as secrets.\n\n\
         -----BEGIN USER NKEY SEED-----\n{seed}\n------END USER NKEY SEED------\n\n\
         *************************************************************\n"
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    const SEED: &str = "SUAMK2FG4MI6UE3ACF3FK3OIQBCEIEZV7NSWFFEW63UXMRLFM2XLAXK4GY";

    #[test]
    fn standard_creds_text_yields_jwt_and_user_key() {
        let text = format("aaa.bbb.ccc", SEED);
        let (jwt, key) = parse(&text).expect("creds");
        assert_eq!(jwt, "aaa.bbb.ccc");
        assert_eq!(
            key.public_key(),
            "UAT6BWCSCWLUKJT6K6MBJJOEOTXZ5AJDOYKNEVRFC7VNO6OA43N4TRNO"
        );
        // CRLF line ends parse the same.
        let (jwt, _) = parse(&text.replace('\n', "\r\n")).expect("creds crlf");
        assert_eq!(jwt, "aaa.bbb.ccc");
    }

    #[test]
    fn creds_without_seed_or_with_a_bad_seed_are_refused() {
        let only_jwt = "-----BEGIN NATS USER JWT-----\na.b.c\n------END NATS USER JWT------\n";
        assert!(matches!(parse(only_jwt), Err(Error::Credentials(_))));
        let bad_seed = format(
            "a.b.c",
            "SUAMK2FG4MI6UE3ACF3FK3OIQBCEIEZV7NSWFFEW63UXMRLFM2XLAXK4GA",
        );
        let err = parse(&bad_seed).expect_err("bad seed");
        assert!(err.to_string().contains("seed"), "{err}");
        assert!(parse("").is_err());
    }
}
