#include <fmt/format.h>

#include <charconv>
#include <cmath>
#include <cstddef>
#include <initializer_list>
#include <optional>
#include <string>
#include <string_view>

#include "ferry/names.hpp"
#include "ferry/sim/api/requests.hpp"
#include "ferry/sim/io/parallelism_json.hpp"
#include "ferry/sim/mesh/rules.hpp"
#include "request_steps.hpp"

namespace ferry::sim {
namespace api {

Status in_bounds(std::string_view option, std::int64_t value, std::int64_t lo, std::int64_t hi) {
  if (value >= lo && value <= hi) return Ok{};
  return Error{fmt::format("{}: {} is not in {}..{}", option, value, lo, hi)};
}

Status first_error(std::initializer_list<Status> checks) {
  for (const Status& check : checks) {
    if (!check) return check;
  }
  return Ok{};
}

}  // namespace api

namespace {

// The request's parallelism as asked, unchecked: a field left out is 0.
Parallelism as_asked(const MeshRequest& fsdp) {
  return Parallelism{.ranks = fsdp.ranks.value_or(0),
                     .nodes = fsdp.nodes.value_or(0),
                     .replicas = fsdp.replicas,
                     .reshard_after_forward = fsdp.reshard_after_forward,
                     .impl = fsdp.impl,
                     .reduce = fsdp.reduce,
                     .tp = fsdp.tp,
                     .cp = fsdp.cp,
                     .ep = fsdp.ep,
                     .expert_capacity = fsdp.expert_capacity,
                     .pp = fsdp.pp};
}

}  // namespace

Result<Parallelism> parallelism_of(const MeshRequest& fsdp) {
  // The numbers in kMeshFields' bounds, in its order (Note [One table of axes]).
  const auto bounded = [](MeshField field, std::int64_t value) {
    const MeshFieldRule& row = mesh_field(field);
    return api::in_bounds(row.flag, value, row.least, row.most);
  };
  const auto bounded_if = [&](MeshField field, const std::optional<std::int32_t>& value) {
    return value ? bounded(field, *value) : Status{Ok{}};
  };
  if (auto in = api::first_error(
          {bounded_if(MeshField::Fsdp, fsdp.ranks), bounded_if(MeshField::Nodes, fsdp.nodes),
           bounded(MeshField::Hsdp, fsdp.replicas), bounded(MeshField::Tp, fsdp.tp),
           bounded(MeshField::Cp, fsdp.cp), bounded(MeshField::Ep, fsdp.ep)});
      !in) {
    return in.error();
  }
  if (fsdp.expert_capacity != 0) {
    const MeshFieldRule& capacity = mesh_field(MeshField::ExpertCapacity);
    if (!capacity.in_bounds(fsdp.expert_capacity)) {
      return Error{fmt::format("{} {}: use a factor from {} to {}", capacity.flag,
                               fsdp.expert_capacity, capacity.least, capacity.most)};
    }
    if (fsdp.ep < capacity.needs_least) {
      return Error{fmt::format("{} needs {} {} or more: {}", capacity.flag,
                               mesh_field(capacity.needs).flag, capacity.needs_least,
                               capacity.why)};
    }
  }
  if (auto stages = bounded(MeshField::Pp, fsdp.pp); !stages) return stages.error();
  const Parallelism p = as_asked(fsdp);
  if (!p.on() && (fsdp.nodes || p.replicas != 1 || p.reshard_after_forward != Reshard::True() ||
                  p.impl != FsdpImpl::Fsdp2 || p.reduce != ReduceDtype::Param)) {
    return Error{fmt::format("{} need {} N", fsdp_option_list(&MeshFieldRule::flag),
                             mesh_field(MeshField::Fsdp).flag)};
  }
  return p;
}

Result<nlohmann::ordered_json> parallelism_section(const MeshRequest& fsdp) {
  auto p = parallelism_of(fsdp);
  if (!p) return p.error();
  if (auto ruled = check_mesh_rules(p.value(), kMeshFlags); !ruled) return ruled.error();
  if (!p.value().on() && p.value().tp == 1 && p.value().pp == 1) return nlohmann::ordered_json{};
  return parallelism_json(p.value());
}

void adopt_parallelism(Parallelism& asked, const Parallelism& file) {
  // A pipeline asked for runs its stages on the mesh asked (Note [A pipeline on the mesh]); a
  // stage count out of bounds is parallelism_of's to refuse.
  if (asked.pp != 1) return;
  asked.pp = file.pp;
  if (!file.sharded()) return;
  if (asked.tp == 1) asked.tp = file.tp;
  if (asked.cp == 1) asked.cp = file.cp;
  if (asked.ep == 1) asked.ep = file.ep;
  if (asked.expert_capacity == 0) asked.expert_capacity = file.expert_capacity;
  if (!file.on()) return;
  if (asked.ranks == 0) asked.ranks = file.ranks;
  if (asked.nodes == 0 && file.nodes > 0) asked.nodes = file.nodes;
  if (asked.replicas == 1) asked.replicas = file.replicas;
  if (asked.reshard_after_forward == Reshard::True()) {
    asked.reshard_after_forward = file.reshard_after_forward;
  }
  if (asked.impl == FsdpImpl::Fsdp2) asked.impl = file.impl;
  if (asked.reduce == ReduceDtype::Param) asked.reduce = file.reduce;
}

MeshRequest trainer_mesh(MeshRequest fsdp, const std::optional<Trainer>& trainer) {
  if (trainer == Trainer::Torchtitan && fsdp.ranks && fsdp.reduce == ReduceDtype::Param) {
    fsdp.reduce = ReduceDtype::Float32;
  }
  return fsdp;
}

void adopt_parallelism(MeshRequest& fsdp, const Parallelism& file) {
  Parallelism asked = as_asked(fsdp);
  adopt_parallelism(asked, file);
  if (!fsdp.ranks && asked.ranks != 0) fsdp.ranks = asked.ranks;
  if (!fsdp.nodes && asked.nodes != 0) fsdp.nodes = asked.nodes;
  fsdp.replicas = asked.replicas;
  fsdp.reshard_after_forward = asked.reshard_after_forward;
  fsdp.impl = asked.impl;
  fsdp.reduce = asked.reduce;
  fsdp.tp = asked.tp;
  fsdp.cp = asked.cp;
  fsdp.ep = asked.ep;
  fsdp.expert_capacity = asked.expert_capacity;
  fsdp.pp = asked.pp;
}

Result<Reshard> parse_reshard(std::string_view text) {
  if (text == "true") return Reshard::True();
  if (text == "false") return Reshard::False();
  std::int64_t k = 0;
  const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), k);
  if (ec != std::errc() || end != text.data() + text.size()) {
    return Error{fmt::format(
        "--reshard-after-forward: \"{}\" is not true, false or a number of ranks (2 or more)",
        text)};
  }
  return reshard_ranks(k);
}

Result<Reshard> reshard_ranks(std::int64_t k) {
  if (!mesh_field(MeshField::ReshardAfterForward).in_bounds(static_cast<double>(k))) {
    return Error{fmt::format(
        "--reshard-after-forward: \"{}\" is not true, false or a number of ranks (2 or more)", k)};
  }
  return Reshard::K(static_cast<std::int32_t>(k));
}

Result<FsdpImpl> fsdp_impl(std::string_view name) {
  if (const auto impl = parse_fsdp_impl(name)) return *impl;
  const auto impl_name = [](FsdpImpl impl) { return to_string(impl); };
  return Error{
      fmt::format("--fsdp-impl: \"{}\" is not {}", name, names_of(kFsdpImpls, impl_name, " or "))};
}

Result<ReduceDtype> reduce_dtype(std::string_view name) {
  if (const auto dtype = parse_reduce_dtype(name)) return *dtype;
  return Error{fmt::format(
      "--reduce-dtype: \"{}\" is not param (the gradients' dtype, torch's default) or float32",
      name)};
}

Result<AllocatorMode> allocator_mode(std::string_view name) {
  if (const auto mode = parse_allocator_mode(name)) return *mode;
  return Error{fmt::format("--allocator: \"{}\" is not default or expandable", name)};
}

Result<Bytes> byte_count(std::string_view text, std::string_view option, bool optional) {
  if (text.find_first_not_of(" \t") == std::string_view::npos) {
    return Error{fmt::format("{}: empty; give a byte count such as 40GiB{}", option,
                             optional ? ", or leave the option out" : "")};
  }
  return parse_bytes(text, option);
}

Result<Bytes> byte_count(std::int64_t count, std::string_view option) {
  if (auto bounded = api::in_bounds(option, count, 0, kMaxByteCount); !bounded) {
    return bounded.error();
  }
  return Bytes(count);
}

Result<std::int32_t> margin_permille(std::string_view text) {
  const auto refused = [&] {
    return Error{fmt::format(
        "--margin: \"{}\" is not a percentage of the budget such as 6, 5.5 or 6%", text)};
  };
  std::string_view s = text;
  const auto trim = [&s] {
    while (!s.empty() && (s.front() == ' ' || s.front() == '\t')) s.remove_prefix(1);
    while (!s.empty() && (s.back() == ' ' || s.back() == '\t')) s.remove_suffix(1);
  };
  trim();
  if (!s.empty() && s.back() == '%') {
    s.remove_suffix(1);
    trim();
  }
  // Whole percent, then at most one decimal: at most "50.0".
  std::int64_t whole = 0;
  const auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), whole);
  if (ec != std::errc{} || end == s.data()) return refused();
  std::int64_t tenths = 0;
  std::string_view rest(end, static_cast<std::size_t>(s.data() + s.size() - end));
  if (!rest.empty()) {
    if (rest.size() != 2 || rest[0] != '.' || rest[1] < '0' || rest[1] > '9') return refused();
    tenths = rest[1] - '0';
  }
  if (s.front() == '-' || whole > kMaxPlanMarginPermille / 10 ||
      whole * 10 + tenths > kMaxPlanMarginPermille) {
    return Error{fmt::format("--margin: {} % is not in 0..{} %", s, kMaxPlanMarginPermille / 10)};
  }
  return static_cast<std::int32_t>(whole * 10 + tenths);
}

Result<std::int32_t> margin_permille(double percent) {
  // As its text: a whole number as itself ("51"), else with the shortest decimals ("50.5").
  const double tenths = percent * 10;
  const bool whole =
      std::isfinite(percent) && percent == std::trunc(percent) && std::fabs(percent) < 1e15;
  const std::string text =
      whole ? fmt::format("{}", static_cast<std::int64_t>(percent)) : fmt::format("{}", percent);
  if (!std::isfinite(percent) ||
      std::fabs(tenths - std::round(tenths)) > 1e-6 * std::fabs(tenths)) {
    return Error{fmt::format(
        "--margin: \"{}\" is not a percentage of the budget such as 6, 5.5 or 6%", text)};
  }
  if (percent < 0 || std::round(tenths) > kMaxPlanMarginPermille) {
    return Error{
        fmt::format("--margin: {} % is not in 0..{} %", text, kMaxPlanMarginPermille / 10)};
  }
  return static_cast<std::int32_t>(std::round(tenths));
}

}  // namespace ferry::sim
