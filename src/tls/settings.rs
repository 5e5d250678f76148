//! TLS settings as the configuration file and the command line give them, merged: a flag
//! wins over the file's member of the same meaning.

use std::net::SocketAddr;
use std::path::PathBuf;

use serde::Deserialize;

use super::files::{ClientFiles, ServerFiles};

/// Configuration `tls`: the listener.
#[derive(Debug, Clone, Default, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields, default)]
pub struct ListenerTls {
    pub cert: Option<PathBuf>,
    pub key: Option<PathBuf>,
    pub client_ca: Option<PathBuf>,
    pub require_client_cert: bool,
    /// A second, plain listener for internal use (metrics on loopback).
    pub plain_listen: Option<SocketAddr>,
}

/// Configuration `nats_tls`: the broker's own NATS connection.
#[derive(Debug, Clone, Default, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields, default)]
pub struct NatsTls {
    pub ca: Option<PathBuf>,
    pub cert: Option<PathBuf>,
    pub key: Option<PathBuf>,
    pub handshake_first: bool,
}

impl ListenerTls {
    /// `self` (the flags) over `file`.
    pub fn over(&self, file: &ListenerTls) -> ListenerTls {
        ListenerTls {
            cert: self.cert.clone().or_else(|| file.cert.clone()),
            key: self.key.clone().or_else(|| file.key.clone()),
            client_ca: self.client_ca.clone().or_else(|| file.client_ca.clone()),
            require_client_cert: self.require_client_cert || file.require_client_cert,
            plain_listen: self.plain_listen.or(file.plain_listen),
        }
    }

    /// The files of the listener's TLS; `None` for a plain listener.
    pub fn files(&self) -> Result<Option<ServerFiles>, String> {
        match (&self.cert, &self.key) {
            (None, None) if self.client_ca.is_some() || self.require_client_cert => {
                Err("client certificates need the listener's --tls-cert and --tls-key".into())
            }
            (None, None) => Ok(None),
            (Some(cert), Some(key)) => Ok(Some(ServerFiles {
                cert: cert.clone(),
                key: key.clone(),
                client_ca: self.client_ca.clone(),
                require_client_cert: self.require_client_cert,
            })),
            _ => Err("--tls-cert and --tls-key go together".into()),
        }
        .and_then(|files| {
            if files
                .as_ref()
                .is_some_and(|f| f.require_client_cert && f.client_ca.is_none())
            {
                return Err("--tls-require-client-cert needs --tls-client-ca".into());
            }
            Ok(files)
        })
    }
}

impl NatsTls {
    pub fn over(&self, file: &NatsTls) -> NatsTls {
        NatsTls {
            ca: self.ca.clone().or_else(|| file.ca.clone()),
            cert: self.cert.clone().or_else(|| file.cert.clone()),
            key: self.key.clone().or_else(|| file.key.clone()),
            handshake_first: self.handshake_first || file.handshake_first,
        }
    }

    /// The files of the NATS connection's TLS; `None` when nothing asks for TLS (a
    /// `tls://` URL still does, trusting the system's CA bundle).
    pub fn files(&self) -> Option<ClientFiles> {
        (self.ca.is_some() || self.cert.is_some() || self.key.is_some()).then(|| ClientFiles {
            ca: self.ca.clone(),
            cert: self.cert.clone(),
            key: self.key.clone(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::broker::config::Config;

    #[test]
    fn the_file_members_parse_and_flags_win_over_them() {
        let c = Config::parse(
            br#"{"tls":{"cert":"f.pem","key":"fk.pem","plain_listen":"127.0.0.1:7421"},
                 "nats_tls":{"ca":"ca.pem","handshake_first":true},
                 "allowed_origins":["https://app.example"]}"#,
        )
        .expect("valid");
        assert_eq!(c.allowed_origins, ["https://app.example"]);
        let flags = ListenerTls {
            cert: Some("flag.pem".into()),
            key: Some("flagk.pem".into()),
            ..ListenerTls::default()
        };
        let merged = flags.over(&c.tls);
        assert_eq!(merged.cert, Some(PathBuf::from("flag.pem")));
        assert_eq!(
            merged.plain_listen,
            Some("127.0.0.1:7421".parse().expect("addr"))
        );
        let files = merged.files().expect("files").expect("TLS");
        assert_eq!(files.key, PathBuf::from("flagk.pem"));
        let nats = NatsTls::default().over(&c.nats_tls);
        assert!(nats.handshake_first);
        assert_eq!(
            nats.files().and_then(|f| f.ca),
            Some(PathBuf::from("ca.pem"))
        );
        assert!(Config::parse(br#"{"tls":{"certificate":"x"}}"#).is_err());
    }

    #[test]
    fn half_a_pair_or_client_certificates_without_a_pair_are_refused() {
        let only_cert = ListenerTls {
            cert: Some("c.pem".into()),
            ..ListenerTls::default()
        };
        assert!(only_cert.files().is_err());
        let ca_alone = ListenerTls {
            client_ca: Some("ca.pem".into()),
            ..ListenerTls::default()
        };
        assert!(ca_alone.files().is_err());
        let required_without_ca = ListenerTls {
            cert: Some("c.pem".into()),
            key: Some("k.pem".into()),
            require_client_cert: true,
            ..ListenerTls::default()
        };
        assert!(required_without_ca.files().is_err());
        assert_eq!(ListenerTls::default().files(), Ok(None));
    }
}
