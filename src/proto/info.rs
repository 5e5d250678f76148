//! INFO and CONNECT payloads as typed structs that keep the fields they do not know
//! (`extra`), so a round trip loses nothing.

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

/// The JSON of a server's `INFO`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct ServerInfo {
    pub server_id: String,
    pub server_name: String,
    pub version: String,
    pub proto: i32,
    pub host: String,
    pub port: u16,
    pub headers: bool,
    pub max_payload: u64,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub client_id: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub client_ip: Option<String>,
    #[serde(skip_serializing_if = "is_false")]
    pub auth_required: bool,
    #[serde(skip_serializing_if = "is_false")]
    pub tls_required: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub nonce: Option<String>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub connect_urls: Vec<String>,
    /// Lame duck mode: the server is about to shut down.
    #[serde(skip_serializing_if = "is_false")]
    pub ldm: bool,
    #[serde(skip_serializing_if = "is_false")]
    pub jetstream: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub domain: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cluster: Option<String>,
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

impl ServerInfo {
    pub fn from_json(json: &[u8]) -> serde_json::Result<Self> {
        serde_json::from_slice(json)
    }
}

/// The JSON of a client's `CONNECT`. Defaults are nats-server's for absent fields
/// (`echo` on) and what this client sends (headers and no_responders on).
#[derive(Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct ConnectOptions {
    pub verbose: bool,
    pub pedantic: bool,
    pub tls_required: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    pub lang: String,
    pub version: String,
    pub protocol: i32,
    pub echo: bool,
    pub headers: bool,
    pub no_responders: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub user: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pass: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub auth_token: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub jwt: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub nkey: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub sig: Option<String>,
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

impl Default for ConnectOptions {
    fn default() -> Self {
        ConnectOptions {
            verbose: false,
            pedantic: false,
            tls_required: false,
            name: None,
            lang: "rust".to_owned(),
            version: env!("CARGO_PKG_VERSION").to_owned(),
            protocol: 1,
            echo: true,
            headers: true,
            no_responders: true,
            user: None,
            pass: None,
            auth_token: None,
            jwt: None,
            nkey: None,
            sig: None,
            extra: Map::new(),
        }
    }
}

impl ConnectOptions {
    pub fn from_json(json: &[u8]) -> serde_json::Result<Self> {
        serde_json::from_slice(json)
    }
}

/// Secrets stay out of logs.
impl std::fmt::Debug for ConnectOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let hide = |s: &Option<String>| s.as_ref().map(|_| "<redacted>");
        f.debug_struct("ConnectOptions")
            .field("verbose", &self.verbose)
            .field("pedantic", &self.pedantic)
            .field("tls_required", &self.tls_required)
            .field("name", &self.name)
            .field("lang", &self.lang)
            .field("version", &self.version)
            .field("protocol", &self.protocol)
            .field("echo", &self.echo)
            .field("headers", &self.headers)
            .field("no_responders", &self.no_responders)
            .field("user", &self.user)
            .field("pass", &hide(&self.pass))
            .field("auth_token", &hide(&self.auth_token))
            .field("jwt", &self.jwt)
            .field("nkey", &self.nkey)
            .field("sig", &hide(&self.sig))
            .field("extra", &self.extra)
            .finish()
    }
}

fn is_false(b: &bool) -> bool {
    !*b
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn server_info_keeps_unknown_fields() {
        let json = br#"{"server_id":"NABC","server_name":"n1","version":"2.15.1","proto":1,"go":"go1.25","host":"0.0.0.0","port":4222,"headers":true,"max_payload":1048576,"jetstream":true,"client_id":5,"client_ip":"127.0.0.1","xkey":"XK","nonce":"abc","auth_required":true,"connect_urls":["10.0.0.1:4222"],"ldm":true}"#;
        let info = ServerInfo::from_json(json).expect("valid");
        assert_eq!(info.server_id, "NABC");
        assert_eq!(info.max_payload, 1_048_576);
        assert_eq!(info.client_id, Some(5));
        assert_eq!(info.nonce.as_deref(), Some("abc"));
        assert!(info.auth_required && info.jetstream && info.headers && info.ldm);
        assert_eq!(info.connect_urls, ["10.0.0.1:4222"]);
        assert_eq!(info.extra.get("go"), Some(&Value::from("go1.25")));
        assert_eq!(info.extra.get("xkey"), Some(&Value::from("XK")));
        let again: Value = serde_json::to_value(&info).expect("serializable");
        let orig: Value = serde_json::from_slice(json).expect("json");
        assert_eq!(again, orig);
    }

    #[test]
    fn connect_options_default_like_nats_server_and_keep_unknown_fields() {
        let c =
            ConnectOptions::from_json(br#"{"lang":"go","user":"u","pass":"secret","x_custom":1}"#)
                .expect("valid");
        assert!(c.echo, "nats-server defaults echo to true");
        assert_eq!(c.user.as_deref(), Some("u"));
        assert_eq!(c.extra.get("x_custom"), Some(&Value::from(1)));
        let shown = format!("{c:?}");
        assert!(!shown.contains("secret"), "{shown}");
        let json = serde_json::to_string(&ConnectOptions::default()).expect("serializable");
        assert!(
            json.contains(r#""headers":true"#) && json.contains(r#""no_responders":true"#),
            "{json}"
        );
        assert!(!json.contains("pass"), "{json}");
    }
}
