//! Serde helpers for the JetStream JSON wire format: durations are integer nanoseconds,
//! and enum-like strings keep values this crate does not know so configs round-trip.

use std::time::Duration;

use serde::{Deserialize, Deserializer, Serializer};

/// A JSON object of fields a typed config does not name; kept so that a config read
/// from the server and written back loses nothing.
pub type Extra = serde_json::Map<String, serde_json::Value>;

fn duration_from_nanos(n: i64) -> Duration {
    // Negative durations mean "unset" in a few server fields; they are not durations.
    Duration::from_nanos(u64::try_from(n).unwrap_or(0))
}

pub(crate) fn nanos_of(d: Duration) -> i64 {
    i64::try_from(d.as_nanos()).unwrap_or(i64::MAX)
}

/// `Option<Duration>` as integer nanoseconds.
pub mod opt_nanos {
    use super::*;

    pub fn serialize<S: Serializer>(v: &Option<Duration>, s: S) -> Result<S::Ok, S::Error> {
        match v {
            Some(d) => s.serialize_i64(nanos_of(*d)),
            None => s.serialize_none(),
        }
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Duration>, D::Error> {
        Ok(Option::<i64>::deserialize(d)?.map(duration_from_nanos))
    }
}

/// `Vec<Duration>` as an array of integer nanoseconds.
pub mod vec_nanos {
    use super::*;
    use serde::ser::SerializeSeq;

    pub fn serialize<S: Serializer>(v: &[Duration], s: S) -> Result<S::Ok, S::Error> {
        let mut seq = s.serialize_seq(Some(v.len()))?;
        for d in v {
            seq.serialize_element(&nanos_of(*d))?;
        }
        seq.end()
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<Duration>, D::Error> {
        Ok(Option::<Vec<i64>>::deserialize(d)?
            .unwrap_or_default()
            .into_iter()
            .map(duration_from_nanos)
            .collect())
    }
}

/// A string enum of the wire format with an `Other` variant that keeps unknown values.
macro_rules! wire_enum {
    ($(#[$meta:meta])* $name:ident { $($(#[$vmeta:meta])* $variant:ident = $text:literal),+ $(,)? }) => {
        $(#[$meta])*
        #[derive(Debug, Clone, PartialEq, Eq, Hash)]
        pub enum $name {
            $($(#[$vmeta])* $variant,)+
            /// A value this crate does not know, kept as sent.
            Other(String),
        }

        impl $name {
            pub fn as_str(&self) -> &str {
                match self {
                    $($name::$variant => $text,)+
                    $name::Other(s) => s.as_str(),
                }
            }
        }

        impl serde::Serialize for $name {
            fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
                s.serialize_str(self.as_str())
            }
        }

        impl<'de> serde::Deserialize<'de> for $name {
            fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
                let s = String::deserialize(d)?;
                Ok(match s.as_str() {
                    $($text => $name::$variant,)+
                    _ => $name::Other(s),
                })
            }
        }
    };
}
pub(crate) use wire_enum;

#[cfg(test)]
mod tests {
    use super::*;
    use serde::{Deserialize, Serialize};

    wire_enum!(Colour { Red = "red", Blue = "blue" });

    #[derive(Serialize, Deserialize, PartialEq, Debug)]
    struct T {
        #[serde(default, with = "opt_nanos", skip_serializing_if = "Option::is_none")]
        d: Option<Duration>,
        #[serde(default, with = "vec_nanos", skip_serializing_if = "Vec::is_empty")]
        v: Vec<Duration>,
        c: Colour,
    }

    #[test]
    fn durations_are_nanoseconds_and_unknown_enum_values_round_trip() {
        let t: T =
            serde_json::from_str(r#"{"d":1500000000,"v":[1000,2000],"c":"green"}"#).expect("parse");
        assert_eq!(t.d, Some(Duration::from_millis(1500)));
        assert_eq!(
            t.v,
            vec![Duration::from_micros(1), Duration::from_micros(2)]
        );
        assert_eq!(t.c, Colour::Other("green".into()));
        let back = serde_json::to_string(&t).expect("encode");
        assert_eq!(back, r#"{"d":1500000000,"v":[1000,2000],"c":"green"}"#);
        let red: Colour = serde_json::from_str("\"red\"").expect("parse");
        assert_eq!(red, Colour::Red);
    }

    #[test]
    fn negative_nanoseconds_read_as_zero_instead_of_failing() {
        let t: T = serde_json::from_str(r#"{"d":-1,"c":"blue"}"#).expect("parse");
        assert_eq!(t.d, Some(Duration::ZERO));
    }
}
