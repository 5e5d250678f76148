//! `$JS.API.INFO`: the account's JetStream usage and limits.

use serde::{Deserialize, Serialize};

use super::wire::Extra;

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ApiStats {
    /// The JetStream API level the server supports (2.11: 1, 2.12: 2...).
    #[serde(default)]
    pub level: u64,
    #[serde(default)]
    pub total: u64,
    #[serde(default)]
    pub errors: u64,
    #[serde(flatten)]
    pub extra: Extra,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct AccountInfo {
    #[serde(default)]
    pub memory: u64,
    #[serde(default)]
    pub storage: u64,
    #[serde(default)]
    pub streams: u64,
    #[serde(default)]
    pub consumers: u64,
    #[serde(default)]
    pub domain: Option<String>,
    #[serde(default)]
    pub api: ApiStats,
    #[serde(flatten)]
    pub extra: Extra,
}
