// An op declared once. Each fused torch op is one Op<Call>: its name, its arguments after the
// team in schema order (each a member of the op's Call struct, with its schema type, default,
// whether the op writes it, and for an enum the enumerators it takes), its returns, the function
// that gives its outputs' shapes and the one that runs it. Everything else follows from it:
//
//   schema_of(op)            the schema TORCH_LIBRARY defines;
//   parse(op, arguments)     a call's arguments off the dispatcher's stack into a Call (a None
//                            for a tensor and an integer that is none of an enum's enumerators
//                            are refused here, naming the argument);
//   write_op_json(out, op)   what python/tpfuse/ops.py builds its wrappers from, beside the
//                            schema: each enum argument's enum and values, the Python order;
//   the boxed kernels of src/torch/ops.cc (CPU, CUDA, Meta) call parse, then shapes or run.
//
// Enums travel as int in the schema; their names come from impl::Enumerators (impl/enums.h).
#pragma once

#include <ATen/ATen.h>
#include <ATen/core/ivalue.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <ostream>
#include <sstream>
#include <string>
#include <type_traits>
#include <vector>

#include "tpfuse/impl/enums.h"

namespace tpfuse::torch_ops {

// An enum by the C++ type's name and its enumerators (value, name).
struct EnumDescription {
  const char* name;
  std::vector<std::pair<int64_t, const char*>> enumerators;
};

template <typename Enum>
const EnumDescription& enum_description() {
  static const EnumDescription description = [] {
    EnumDescription d{impl::Enumerators<Enum>::kName, {}};
    for (const auto& enumerator : impl::Enumerators<Enum>::kList) {
      d.enumerators.emplace_back(int64_t(enumerator.value), enumerator.name);
    }
    return d;
  }();
  return description;
}

// The schema's name of a Call member's type.
template <typename T>
constexpr const char* schema_type() {
  if constexpr (std::is_same_v<T, at::Tensor>) {
    return "Tensor";
  } else if constexpr (std::is_same_v<T, std::optional<at::Tensor>>) {
    return "Tensor?";
  } else if constexpr (std::is_same_v<T, double>) {
    return "float";
  } else if constexpr (std::is_same_v<T, bool>) {
    return "bool";
  } else {
    static_assert(std::is_same_v<T, int64_t> || std::is_enum_v<T>,
                  "no schema type for this member");
    return "int";
  }
}

template <typename Member>
struct MemberOf;
template <typename Class, typename Type>
struct MemberOf<Type Class::*> {
  using Call = Class;
  using T = Type;
};

// One argument of an op (after its team): a member of the op's Call.
template <typename Call>
struct Argument {
  const char* name = nullptr;
  const char* type = nullptr;  // in the schema
  std::string default_text;    // in the schema ("" for none)
  bool is_written = false;     // Tensor(a!): the op writes into it
  bool is_required = false;    // an optional<at::Tensor> member this op requires
  const EnumDescription* enumeration = nullptr;
  std::vector<int64_t> values;                  // an enum's: the enumerators the op takes
  std::optional<int64_t> python_default_value;  // where the Python wrapper has one, the schema not
  void (*read)(Call& call, const c10::IValue& value, const char* op,
               const Argument& argument) = nullptr;

  // The op writes into this tensor (in place): Tensor(a!) in the schema.
  Argument written() const {
    Argument argument = *this;
    argument.is_written = true;
    return argument;
  }
  // An optional<at::Tensor> member that this op requires: Tensor in the schema, None refused.
  Argument required() const {
    Argument argument = *this;
    argument.type = "Tensor";
    argument.is_required = true;
    return argument;
  }
  // This op does not take `value` of the enum.
  template <typename Enum>
  Argument except(Enum value) const {
    Argument argument = *this;
    argument.values.erase(
        std::remove(argument.values.begin(), argument.values.end(), int64_t(value)),
        argument.values.end());
    return argument;
  }
  // The Python wrapper's default for an argument the schema gives none (it comes later there).
  Argument python_default(int64_t value) const {
    Argument argument = *this;
    argument.python_default_value = value;
    return argument;
  }

  // "0 (auto), 1 (oneshot) or 2 (twoshot)": the values this enum argument takes.
  std::string expected() const {
    std::ostringstream out;
    for (size_t i = 0; i < values.size(); ++i) {
      if (i > 0) out << (i + 1 == values.size() ? " or " : ", ");
      out << values[i];
      for (const auto& [value, name] : enumeration->enumerators) {
        if (value == values[i]) out << " (" << name << ")";
      }
    }
    return out.str();
  }
};

// An argument's value as the Call member's type T.
template <typename T, typename Call>
T read_as(const c10::IValue& value, const char* op, const Argument<Call>& argument) {
  if constexpr (std::is_same_v<T, at::Tensor> || std::is_same_v<T, std::optional<at::Tensor>>) {
    const bool given = !value.isNone() && value.toTensor().defined();
    // The dispatcher lets None through where the schema has a tensor.
    TORCH_CHECK_TYPE(given || !(std::is_same_v<T, at::Tensor> || argument.is_required),
                     "tpfuse::", op, ": ", argument.name, " must be a tensor, got None",
                     argument.is_written ? " (the op writes into it)" : "");
    if (!given) return T();
    return value.toTensor();
  } else if constexpr (std::is_same_v<T, double>) {
    return value.toDouble();
  } else if constexpr (std::is_same_v<T, bool>) {
    return value.toBool();
  } else if constexpr (std::is_same_v<T, int64_t>) {
    return value.toInt();
  } else {
    static_assert(std::is_enum_v<T>);
    // Checked as the 64-bit integer it arrives as, before any cast (2^32 + 1 is not 1).
    const int64_t number = value.toInt();
    const auto& values = argument.values;
    TORCH_CHECK(std::find(values.begin(), values.end(), number) != values.end(), "tpfuse::", op,
                ": ", argument.name, " must be ", argument.expected(), ", got ", number);
    return T(int(number));
  }
}

template <auto kMember>
void read_member(typename MemberOf<decltype(kMember)>::Call& call, const c10::IValue& value,
                 const char* op, const Argument<typename MemberOf<decltype(kMember)>::Call>& arg) {
  call.*kMember = read_as<typename MemberOf<decltype(kMember)>::T>(value, op, arg);
}

// An argument without a default: arg<&Call::member>("member").
template <auto kMember>
Argument<typename MemberOf<decltype(kMember)>::Call> arg(const char* name) {
  using T = typename MemberOf<decltype(kMember)>::T;
  Argument<typename MemberOf<decltype(kMember)>::Call> argument;
  argument.name = name;
  argument.type = schema_type<T>();
  argument.read = &read_member<kMember>;
  if constexpr (std::is_enum_v<T>) {
    argument.enumeration = &enum_description<T>();
    for (const auto& enumerator : argument.enumeration->enumerators) {
      argument.values.push_back(enumerator.first);
    }
  }
  return argument;
}

// An argument with a default (std::nullopt for an optional tensor's None).
template <auto kMember, typename Default>
Argument<typename MemberOf<decltype(kMember)>::Call> arg(const char* name, Default value) {
  auto argument = arg<kMember>(name);
  if constexpr (std::is_same_v<Default, std::nullopt_t>) {
    argument.default_text = "None";
  } else if constexpr (std::is_same_v<Default, bool>) {
    argument.default_text = value ? "True" : "False";
  } else {
    static_assert(std::is_enum_v<Default> || std::is_integral_v<Default>);
    argument.default_text = std::to_string(int64_t(value));
  }
  return argument;
}

// What an op's shape and run functions know of the op besides its arguments.
struct OpForm {
  const char* name;  // for messages: "tpfuse::<name>: ..."
  bool in_place;     // some argument is written: the outputs it stands for are not returned
};

class Launch;

template <typename Call>
struct Op {
  using CallType = Call;

  const char* name;
  std::vector<Argument<Call>> arguments;  // after `int team`, in schema order
  std::vector<const char*> returns;       // the tensors' names; {nullptr}: one unnamed tensor
  // The outputs (as at::empty, on the arguments' device: Meta's are its results, and a real
  // call's are allocated by it), `returns` of them.
  std::vector<at::Tensor> (*shapes)(const Call& call, const OpForm& form);
  // The real call: torch's checks, its outputs (through shapes), the library's arguments, then
  // launch(library call). Returns the outputs.
  std::vector<at::Tensor> (*run)(const Call& call, const OpForm& form, Launch& launch);
  // The Python wrapper's parameter order after the team, where it is not the schema's: names
  // separated by spaces.
  const char* python_order = nullptr;

  OpForm form() const {
    const bool in_place = std::any_of(arguments.begin(), arguments.end(),
                                      [](const Argument<Call>& a) { return a.is_written; });
    return {name, in_place};
  }
};

// The op's arguments (all of them, the team first) read into a Call.
template <typename Call>
Call parse(const Op<Call>& op, c10::ArrayRef<c10::IValue> arguments) {
  Call call;
  for (size_t i = 0; i < op.arguments.size(); ++i) {
    op.arguments[i].read(call, arguments[i + 1], op.name, op.arguments[i]);
  }
  return call;
}

template <typename Call>
std::string schema_of(const Op<Call>& op) {
  std::ostringstream out;
  out << op.name << "(int team";
  char alias = 'a';
  for (const Argument<Call>& argument : op.arguments) {
    out << ", " << argument.type;
    if (argument.is_written) out << "(" << alias++ << "!)";
    out << " " << argument.name;
    if (!argument.default_text.empty()) out << "=" << argument.default_text;
  }
  out << ") -> ";
  if (op.returns.size() == 1 && op.returns[0] == nullptr) return out.str() + "Tensor";
  out << "(";
  for (size_t i = 0; i < op.returns.size(); ++i) {
    out << (i > 0 ? ", " : "") << "Tensor " << op.returns[i];
  }
  out << ")";
  return out.str();
}

// The Python wrapper's parameters after the team: python_order, checked to name each argument
// once, or the schema's order.
template <typename Call>
std::vector<std::string> python_order(const Op<Call>& op) {
  std::vector<std::string> names;
  if (op.python_order == nullptr) {
    for (const Argument<Call>& argument : op.arguments) names.emplace_back(argument.name);
    return names;
  }
  std::istringstream words(op.python_order);
  for (std::string word; words >> word;) names.push_back(word);
  std::vector<std::string> sorted_names = names;
  std::vector<std::string> schema_names;
  for (const Argument<Call>& argument : op.arguments) schema_names.emplace_back(argument.name);
  std::sort(sorted_names.begin(), sorted_names.end());
  std::sort(schema_names.begin(), schema_names.end());
  TORCH_CHECK(sorted_names == schema_names, "tpfuse::", op.name,
              ": python_order must name each argument once: ", op.python_order);
  return names;
}

// The op as python/tpfuse/ops.py reads it (JSON): "name": {"python": [parameters after the
// team], "enums": {argument: {"enum": C++ type, "values": [taken]}}, "python_defaults": {...}}.
template <typename Call>
void write_op_json(std::ostream& out, const Op<Call>& op) {
  out << "\"" << op.name << "\": {\"python\": [";
  const std::vector<std::string> order = python_order(op);
  for (size_t i = 0; i < order.size(); ++i) out << (i > 0 ? ", " : "") << "\"" << order[i] << "\"";
  out << "], \"enums\": {";
  const char* separator = "";
  for (const Argument<Call>& argument : op.arguments) {
    if (argument.enumeration == nullptr) continue;
    out << separator << "\"" << argument.name << "\": {\"enum\": \"" << argument.enumeration->name
        << "\", \"values\": [";
    for (size_t i = 0; i < argument.values.size(); ++i) {
      out << (i > 0 ? ", " : "") << argument.values[i];
    }
    out << "]}";
    separator = ", ";
  }
  out << "}, \"python_defaults\": {";
  separator = "";
  for (const Argument<Call>& argument : op.arguments) {
    if (!argument.python_default_value) continue;
    out << separator << "\"" << argument.name << "\": " << *argument.python_default_value;
    separator = ", ";
  }
  out << "}}";
}

// An enum as python/tpfuse/ops.py reads it: "name": {"enumerator": value, ...}.
inline void write_enum_json(std::ostream& out, const EnumDescription& enumeration) {
  out << "\"" << enumeration.name << "\": {";
  for (size_t i = 0; i < enumeration.enumerators.size(); ++i) {
    out << (i > 0 ? ", " : "") << "\"" << enumeration.enumerators[i].second
        << "\": " << enumeration.enumerators[i].first;
  }
  out << "}";
}

}  // namespace tpfuse::torch_ops
