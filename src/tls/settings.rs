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
