//! Reading a batch step (`{"step": "claim", "receipt": …}`) without
//! buffering it. serde's derive for an internally tagged enum first copies
//! the whole object into an untyped tree, then reads the variant from that
//! — most of what the daemon spent on a batch's body. The tag comes first
//! in everything this crate writes, so the step's own fields are read
//! straight from the stream after it; an object with its tag elsewhere is
//! still read, by way of a `serde_json::Value`.

use serde::de::value::MapAccessDeserializer;
use serde::de::{self, Deserializer, MapAccess, Visitor};
use serde::{Deserialize, de::IntoDeserializer};

use crate::wire::BatchStep;

const STEPS: &[&str] = &[
    "prepare", "publish", "claim", "adopt", "loaded", "ack", "fail", "release", "abort", "cancel", "read", "end_read",
];

/// The step named `name`, its fields read from `d`.
fn step<'de, D: Deserializer<'de>>(name: &str, d: D) -> Result<BatchStep, D::Error> {
    Ok(match name {
        "prepare" => BatchStep::Prepare(Deserialize::deserialize(d)?),
        "publish" => BatchStep::Publish(Deserialize::deserialize(d)?),
        "claim" => BatchStep::Claim(Deserialize::deserialize(d)?),
        "adopt" => BatchStep::Adopt(Deserialize::deserialize(d)?),
        "loaded" => BatchStep::Loaded(Deserialize::deserialize(d)?),
        "ack" => BatchStep::Ack(Deserialize::deserialize(d)?),
        "fail" => BatchStep::Fail(Deserialize::deserialize(d)?),
        "release" => BatchStep::Release(Deserialize::deserialize(d)?),
        "abort" => BatchStep::Abort(Deserialize::deserialize(d)?),
        "cancel" => BatchStep::Cancel(Deserialize::deserialize(d)?),
        "read" => BatchStep::Read(Deserialize::deserialize(d)?),
        "end_read" => BatchStep::EndRead(Deserialize::deserialize(d)?),
        other => return Err(de::Error::unknown_variant(other, STEPS)),
    })
}

struct StepVisitor;

impl<'de> Visitor<'de> for StepVisitor {
    type Value = BatchStep;

    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("a batch step: an object with a \"step\" naming it and that step's fields")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<BatchStep, A::Error> {
        let Some(first) = map.next_key::<std::borrow::Cow<'de, str>>()? else {
            return Err(de::Error::missing_field("step"));
        };
        if first == "step" {
            let name = map.next_value::<std::borrow::Cow<'de, str>>()?;
            return step(&name, MapAccessDeserializer::new(map));
        }
        // The tag is not first: take the object whole, then read it.
        let mut fields = serde_json::Map::new();
        fields.insert(first.into_owned(), map.next_value()?);
        while let Some((k, v)) = map.next_entry::<String, serde_json::Value>()? {
            fields.insert(k, v);
        }
        let name = match fields.remove("step") {
            Some(serde_json::Value::String(name)) => name,
            Some(other) => return Err(de::Error::custom(format!("\"step\" must be a step's name, not {other}"))),
            None => return Err(de::Error::missing_field("step")),
        };
        step(&name, serde_json::Value::Object(fields).into_deserializer()).map_err(de::Error::custom)
    }
}

impl<'de> Deserialize<'de> for BatchStep {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_map(StepVisitor)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_step_reads_the_same_with_its_tag_first_or_last_and_an_unknown_one_is_named() {
        let first = r#"{"step":"cancel","req_id":"r-1"}"#;
        let last = r#"{"req_id":"r-1","step":"cancel"}"#;
        for text in [first, last] {
            let s: BatchStep = serde_json::from_str(text).unwrap();
            assert!(matches!(&s, BatchStep::Cancel(c) if c.req_id == "r-1"), "{text}: {s:?}");
            assert_eq!(serde_json::to_string(&s).unwrap(), first, "written with its tag first");
        }
        let e = serde_json::from_str::<BatchStep>(r#"{"step":"steal","req_id":"r"}"#).unwrap_err().to_string();
        assert!(e.contains("unknown variant `steal`") && e.contains("cancel"), "{e}");
        let e = serde_json::from_str::<BatchStep>(r#"{"req_id":"r"}"#).unwrap_err().to_string();
        assert!(e.contains("missing field `step`"), "{e}");
        let e = serde_json::from_str::<BatchStep>(r#"{"step":"cancel"}"#).unwrap_err().to_string();
        assert!(e.contains("missing field `req_id`"), "{e}");
        let e = serde_json::from_str::<BatchStep>(r#"{"req_id":"r","step":7}"#).unwrap_err().to_string();
        assert!(e.contains("must be a step's name"), "{e}");
    }
}
