//! Namespaces homed in a JetStream domain (`namespaces.<ns>.jetstream_domain`): which API
//! prefix serves a namespace, and which handle of the shared task store a task's key is
//! written through. A site broker reaches a fleet namespace's streams in the hub's domain
//! while its local namespaces stay in the site's own JetStream.

use std::collections::BTreeMap;

use super::binding;
use super::config::Config;
use crate::jetstream::kv::{Kv, KvEntry};
use crate::jetstream::{ApiPrefix, JsError, MsgTtl, Request};
use crate::proto::headers::HeaderMap;

/// The JetStream API of every namespace.
#[derive(Debug, Clone)]
pub struct JsApis {
    local: ApiPrefix,
    by_ns: BTreeMap<String, ApiPrefix>,
}

impl JsApis {
    pub fn new(config: &Config) -> JsApis {
        JsApis {
            local: ApiPrefix::default(),
            by_ns: config
                .namespaces
                .iter()
                .filter(|(_, n)| n.jetstream_domain.is_some())
                .map(|(ns, n)| (ns.clone(), n.js_api()))
                .collect(),
        }
    }

    pub fn of(&self, ns: &str) -> &ApiPrefix {
        self.by_ns.get(ns).unwrap_or(&self.local)
    }
}

/// The task store (`AMP_TASK_STATE`, keys `<ns>.<task>`). Every domain has its own bucket
/// of that name, so a task is read and written in its namespace's domain.
#[derive(Debug, Clone)]
pub struct TaskKv {
    local: Kv,
    by_ns: BTreeMap<String, Kv>,
}

impl TaskKv {
    pub fn new(config: &Config) -> Result<TaskKv, JsError> {
        let apis = JsApis::new(config);
        let mut by_ns = BTreeMap::new();
        for ns in apis.by_ns.keys() {
            by_ns.insert(
                ns.clone(),
                Kv::new(apis.of(ns).clone(), binding::TASK_STATE_BUCKET)?,
            );
        }
        Ok(TaskKv {
            local: Kv::new(ApiPrefix::default(), binding::TASK_STATE_BUCKET)?,
            by_ns,
        })
    }

    /// The handle for `key` = `<ns>.<task>` (namespaces never contain a dot).
    fn of(&self, key: &str) -> &Kv {
        let ns = key.split('.').next().unwrap_or_default();
        self.by_ns.get(ns).unwrap_or(&self.local)
    }

    pub fn create_request(
        &self,
        key: &str,
        value: &[u8],
        ttl: Option<MsgTtl>,
    ) -> Result<Request, JsError> {
        self.of(key).create_request(key, value, ttl)
    }

    /// A compare-and-set on `revision` that leaves the key this revision only
    /// ([`Kv::replace_request`]).
    pub fn replace_request(
        &self,
        key: &str,
        value: &[u8],
        revision: u64,
        ttl: Option<MsgTtl>,
    ) -> Result<Request, JsError> {
        self.of(key).replace_request(key, value, revision, ttl)
    }

    pub fn get_request(&self, key: &str) -> Result<Request, JsError> {
        self.of(key).get_request(key)
    }

    pub fn parse_get(
        &self,
        key: &str,
        headers: Option<&HeaderMap>,
        payload: &[u8],
    ) -> Result<KvEntry, JsError> {
        self.of(key).parse_get(key, headers, payload)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config() -> Config {
        Config::parse(br#"{"namespaces": {"local": {}, "fleet": {"jetstream_domain": "hub"}}}"#)
            .expect("config")
    }

    #[test]
    fn a_domain_namespace_uses_its_domain_api_and_the_others_the_local_one() {
        let apis = JsApis::new(&config());
        assert_eq!(apis.of("fleet").as_str(), "$JS.hub.API");
        assert_eq!(apis.of("local").as_str(), "$JS.API");
        assert_eq!(apis.of("unknown").as_str(), "$JS.API");
    }

    #[test]
    fn task_store_writes_and_reads_go_to_the_namespace_domain() {
        let kv = TaskKv::new(&config()).expect("kv");
        let put = kv.create_request("fleet.t1", b"{}", None).expect("put");
        assert_eq!(put.subject, "$JS.hub.API.$KV.AMP_TASK_STATE.fleet.t1");
        let get = kv.get_request("fleet.t1").expect("get");
        assert!(
            get.subject
                .starts_with("$JS.hub.API.DIRECT.GET.KV_AMP_TASK_STATE"),
            "{}",
            get.subject
        );
        let local = kv.replace_request("local.t2", b"{}", 4, None).expect("put");
        assert_eq!(local.subject, "$KV.AMP_TASK_STATE.local.t2");
        assert!(
            kv.get_request("local.t2")
                .expect("get")
                .subject
                .starts_with("$JS.API.DIRECT.GET.")
        );
    }

    #[test]
    fn a_bad_domain_is_refused_with_the_member_named() {
        let e = Config::parse(br#"{"namespaces": {"f": {"jetstream_domain": "a.b"}}}"#)
            .expect_err("refused");
        assert!(
            e.to_string().contains("namespaces.f.jetstream_domain"),
            "{e}"
        );
    }
}
